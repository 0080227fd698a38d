"""DeepSpeed's own load of a checkpoint in the layout that saved it, read through mmap.

DeepSpeed (0.19.8, engine._get_all_zero_checkpoint_state_dicts; engine._load_checkpoint for the model states)
reads each file whole with torch.load: under CPU optimizer offload the ZeRO file is this process's fp32 master
weights and Adam's two states, 12 bytes a trained parameter of anonymous memory (11 GiB for SD1.5), beside a
training that already holds as much, so a machine that trains could not resume. Read with mmap=True, the file's
pages are the page cache's, which the kernel drops before it runs out of memory (the OOM killer counts anonymous
memory only): the master weights are copied into the training's own buffers, and each of Adam's states the
optimizer took over is copied out of the mapping, one at a time, into memory of the process's own, as a fresh
run allocates them at its first step. Nothing then holds the mapping: a later save_state that replaces the
checkpoint frees its disk space. nvme_resume.py maps the NVMe tier's file the same way for its own reading.
"""

import contextlib


@contextlib.contextmanager
def mapped(engines):
    """While DeepSpeed loads into ``engines``, its torch.load maps the files instead of reading them."""
    import torch

    patched, mapped_at = [], set()  # the data pointers of what the mapped files hold
    for engine in engines:
        if getattr(engine.optimizer, "swap_optimizer", False):
            continue  # NVMe: its states stay on the disk, and nvme_resume.py maps the file itself
        checkpoint_engine = getattr(engine, "checkpoint_engine", None)
        if checkpoint_engine is None or type(checkpoint_engine).__name__ != "TorchCheckpointEngine":
            continue  # another engine (Nebula, decoupled): its own reading

        def load(path, map_location=None):
            loaded = torch.load(path, map_location=map_location, weights_only=False, mmap=True)
            mapped_at.update(t.data_ptr() for t in _tensors(loaded))
            return loaded

        checkpoint_engine.load = load
        patched.append(checkpoint_engine)
    try:
        yield
    finally:
        for checkpoint_engine in patched:
            checkpoint_engine.__dict__.pop("load", None)
    for engine in engines:
        if mapped_at:
            _own_states(getattr(engine.optimizer, "optimizer", engine.optimizer), mapped_at)


def _tensors(value):
    import torch

    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _own_states(optimizer, mapped_at):
    """Copy each optimizer state that still reads from a mapped file into memory of its own."""
    import torch

    for state in getattr(optimizer, "state", {}).values():
        for key, value in list(state.items()):
            if torch.is_tensor(value) and value.data_ptr() in mapped_at:
                state[key] = value.clone()
