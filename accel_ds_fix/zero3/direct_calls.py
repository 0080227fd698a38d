"""ZeRO-3: a script that calls the parts of its prepared model itself, not through the engine.

kohya's `--deepspeed` (sdxl_train.py, train_db.py, ...) wraps its models in one module for prepare() and then calls
each model directly, never the engine. DeepSpeed gathers a weight when the module that owns it runs. A module that
reads a child's weight before calling it sees the empty shard: transformers' CLIP embeddings check
``position_embedding.weight.shape[0]`` and stop with "max_position_embeddings: 0", with DeepSpeed alone too.
Inside the engine's forward DeepSpeed marks every module "in forward", and there such a read gathers the weight
(an "external parameter"). Here a direct call marks the module it calls and what that module holds, for as long as
it runs, the recomputation of gradient checkpointing included.
"""

from ..lookup import engine_record


def _marked(module):
    return getattr(module._parameters, "_in_forward", False)


def _mark(module, value):
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict

    for sub in module.modules():
        ensure_zero_ordered_dict(sub)
        if isinstance(sub._parameters, ZeROOrderedDict):
            sub._parameters._in_forward = value


def watch(engine):
    """Mark a module of the engine and what it holds as in forward while it runs outside the engine's own forward
    (its own subtree only: each recomputed block of gradient checkpointing marks its few modules, not the model's
    thousands); weights/read_alone.py reads the flag it leaves in the engine's record."""
    record = engine_record(engine)
    if record.called_in_parts:
        return
    record.called_in_parts = True
    marking = []  # the modules whose call set the marks, innermost last

    def before(module, args):
        if not _marked(module):  # neither the engine's forward nor an outer call marked it
            _mark(module, True)
            marking.append(module)

    def after(module, args, output):
        if marking and marking[-1] is module:
            marking.pop()
            _mark(module, False)

    for module in engine.module.modules():
        module.register_forward_pre_hook(before, prepend=True)
        module.register_forward_hook(after, always_call=True)
