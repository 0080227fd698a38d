"""ZeRO-3: a script that calls the parts of its prepared model itself, not through the engine.

kohya's `--deepspeed` (sdxl_train.py, train_db.py, ...) wraps its models in one module for prepare() and then calls
each model directly, never the engine. DeepSpeed gathers a weight when the module that owns it runs. A module that
reads a child's weight before calling it sees the empty shard: transformers' CLIP embeddings check
``position_embedding.weight.shape[0]`` and stop with "max_position_embeddings: 0", with DeepSpeed alone too.
Inside the engine's forward DeepSpeed marks every module "in forward", and there such a read gathers the weight
(an "external parameter"). Here a direct call gets the same marking for as long as it runs, the recomputation of
gradient checkpointing included.
"""

import weakref


def _marked(module):
    return getattr(module._parameters, "_in_forward", False)


def _mark(root, value):
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict

    for module in root.modules():
        ensure_zero_ordered_dict(module)
        if isinstance(module._parameters, ZeROOrderedDict):
            module._parameters._in_forward = value


def watch(engine):
    """Mark the engine's modules as in forward while a module of it runs outside the engine's own forward."""
    root = engine.module
    if getattr(root, "_accel_ds_fix_direct_calls", False):
        return
    root._accel_ds_fix_direct_calls = True
    engine._accel_ds_fix_called_in_parts = True  # checkpoints/read_alone.py keeps copies for a read on one process
    root_ref = weakref.ref(root)
    marking = []  # the modules whose call set the marks, innermost last

    def before(module, args):
        root = root_ref()
        if root is not None and not _marked(module):  # neither the engine's forward nor an outer call marked it
            _mark(root, True)
            marking.append(module)

    def after(module, args, output):
        root = root_ref()
        if marking and marking[-1] is module:
            marking.pop()
            if root is not None:
                _mark(root, False)

    for module in root.modules():
        module.register_forward_pre_hook(before, prepend=True)
        module.register_forward_hook(after, always_call=True)
