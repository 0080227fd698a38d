"""ZeRO-3 with several processes: the trained weights read on the main process alone.

Every diffusers DreamBooth script exports after training under ``if accelerator.is_main_process:``
(``get_peft_model_state_dict(unwrap_model(transformer))``, ``save_pretrained``). ZeRO-3 partitions each weight
across the processes, and gathering one is a collective: read on one process, it waited for the others, which had
finished training and left. So at each ``accelerator.wait_for_everyone()`` after an optimizer step (the scripts
call it right before exporting), every process keeps a host copy of the trained weights, where they are a LoRA's
size (at most SNAPSHOT_LIMIT_BYTES), with the frozen ones where they are fewer (a full fine-tune's), until the first forward after the next
step; a ``state_dict()`` takes those while no step has run since. Frozen weights
that ZeRO-3 partitioned beyond that (a LoRA's base) can still only be gathered by every process together: read on one
process, they stay shape-[0] shards in that state dict, with a warning (a LoRA export drops them), and a trained
weight without its copy stops the read with what to do, instead of a wait without end."""

import logging
import weakref

from .. import notices
from ..errors import CheckpointError
from ..lookup import engines_read_in_parts
from ..processes import every_process
from .partitioned import is_partitioned, shards

# A host copy on every process: a LoRA's trained weights are megabytes; a full fine-tune's are the model.
SNAPSHOT_LIMIT_BYTES = 2 * 2**30
# What is gathered onto the card at once for the copies.
CHUNK_BYTES = 64 * 2**20
# Processes that read together come within seconds of each other (they leave the same barrier); one that comes
# later than this reads alone too (every_process.missing decides alike for all).
TOGETHER_S = 10

_copies = {}  # id(trained partitioned parameter) -> (a weak reference to it, its full value on the host)
_taken_at = None  # (weak references to the engines, their global_steps) when _copies were taken
_drop_hooks = []  # forward pre-hooks on the engines' modules that drop stale copies


def _steps(engines):
    return tuple(getattr(e, "global_steps", 0) for e in engines)


def snapshot_at_barrier(wrapped, instance, args, kwargs):
    """Accelerator.wait_for_everyone: after the barrier, the host copies of the trained ZeRO-3 weights (every
    process is here, so gathering is safe), once per optimizer step."""
    result = wrapped(*args, **kwargs)
    engines = engines_read_in_parts(instance) if every_process.several_processes() else []
    if engines and getattr(engines[0], "zero_optimization_stage", lambda: 0)() == 3:
        _take(engines)
    return result


def _take(engines):
    global _taken_at
    steps = _steps(engines)
    if _taken_at is not None and _same(_taken_at[0], engines) and _taken_at[1] == steps:
        return
    partitioned = [p for e in engines for p in e.module.parameters() if is_partitioned(p)]
    trained = [p for p in partitioned if p.requires_grad]
    forget()
    if not trained or _bytes(trained) > SNAPSHOT_LIMIT_BYTES:
        return
    # the frozen weights too where they are the few of a full fine-tune (kohya freezes CLIP-L's last layer and saves
    # the whole model), not a LoRA's base
    frozen = [p for p in partitioned if not p.requires_grad]
    few = _bytes(frozen) <= _bytes(trained) and _bytes(partitioned) <= SNAPSHOT_LIMIT_BYTES
    kept = partitioned if few else trained
    import deepspeed

    for chunk in _chunks(kept):  # a few collectives for a LoRA's hundreds of weights, little on the card at once
        with deepspeed.zero.GatheredParameters(chunk, modifier_rank=None):
            for param in chunk:
                _copies[id(param)] = (weakref.ref(param), param.data.detach().to("cpu", copy=True))
    _taken_at = ([weakref.ref(e) for e in engines], steps)
    # the copies are dropped at the first forward after the next step: host memory only while they can be read
    # (on every module: kohya's --deepspeed calls the models inside its wrapper, never the wrapper)
    _drop_hooks.extend(m.register_forward_pre_hook(_drop_when_stale) for e in engines for m in e.module.modules())


def _bytes(params):
    return sum(p.ds_numel * p.element_size() for p in params)


def _drop_when_stale(*_):
    engines = [r() for r in _taken_at[0]] if _taken_at else []
    if not engines or any(e is None for e in engines) or _steps(engines) != _taken_at[1]:
        forget()


def forget():
    """Drop the copies: the weights change without an optimizer step (load_state), or they stepped."""
    global _taken_at
    _copies.clear()
    _taken_at = None
    while _drop_hooks:
        _drop_hooks.pop().remove()


def _chunks(params):
    chunk, size = [], 0
    for param in params:
        chunk.append(param)
        size += param.ds_numel * param.element_size()
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _same(references, engines):
    return len(references) == len(engines) and all(r() is e for r, e in zip(references, engines))


def _fresh(param):
    if _taken_at is None or id(param) not in _copies or _copies[id(param)][0]() is not param:
        return None
    engines = [r() for r in _taken_at[0]]
    if any(e is None for e in engines) or _steps(engines) != _taken_at[1]:
        return None
    return _copies[id(param)][1]


def full_values(module, params):
    """{id(param): tensor} for the partitioned ``params`` of ``module``'s state dict that need no collective now:
    fresh host copies of trained weights, and, where this process reads alone, the frozen shards as they are.
    The rest the caller gathers (every process is reading)."""
    if not every_process.several_processes():
        return {}
    partitioned = shards(params)  # gathered already (a save hook runs inside a gather): read as they are
    if not partitioned:
        return {}
    values = {}
    for param in partitioned:
        copy = _fresh(param)
        if copy is not None:
            values[id(param)] = copy.to(param.dtype, copy=True)  # the caller may change what it gets
    rest = [p for p in partitioned if id(p) not in values]
    if not rest or not every_process.missing("state_dict", TOGETHER_S):
        return values  # every process reads: the caller gathers the rest together
    name = type(module).__name__
    trained = [p for p in rest if p.requires_grad]
    if trained:
        raise CheckpointError(
            f"accel_ds_fix: state_dict() of {name} was asked on process {every_process.rank()} alone, and "
            f"{len(trained)} of its trained weights are partitioned across the processes by ZeRO-3: only every "
            "process together can gather them. Call accelerator.wait_for_everyone() on every process after the last "
            "optimizer step and before reading them (a LoRA's weights are then kept whole on each process), or read "
            "them on every process (accelerator.get_state_dict(model), then save on the main process), or train "
            "with ZeRO-2, which keeps each process's weights whole. The run's last save_state holds them."
        )
    for param in rest:
        values[id(param)] = param.data  # the shard: shape [0]
    notices.say(
        f"state_dict() of {name} on process {every_process.rank()} alone: its {len(rest)} frozen weights partitioned "
        "by ZeRO-3 across the processes are in it as shape-[0] tensors (only every process together can gather "
        "them); its trained weights are whole. A LoRA export keeps only those; for the whole model read it on every "
        "process (accelerator.get_state_dict(model)).", level=logging.WARNING, once_key=("read_alone", name))
    return values
