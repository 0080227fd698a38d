"""Separate, full tensors from the state dict of a merged model, whatever DeepSpeed did to its parameters.

- ZeRO-3 keeps each parameter outside forward as a shape-[0] shard: its full value is gathered.
- ZeRO-1/2 (and DeepSpeed's fp16/bf16 optimizers) make each trained parameter a view into one flat buffer that
  all merged models share: every tensor of such a state dict shares one storage. ``torch.save`` would write the
  whole buffer into each model's file and old safetensors (0.3.x, kohya's January 2023 pins) refuses to save it
  ("Some tensors share memory"). Each view is copied out.

A state_dict hook on every merged model does this whenever ``model.state_dict()`` is called on the model
itself (``unwrap_model(m).state_dict()``, ``save_pretrained``, ``get_state_dict(m)``, kohya's
``network.save_weights``): copies on the host, one parameter at a time, so the card never holds a second copy
of a model. A parameter the model ties under two names stays one tensor under both, as without DeepSpeed.
DeepSpeed's own checkpointing calls ``state_dict()`` on the merged module, which reaches each model with a
non-empty prefix: those calls are left to DeepSpeed untouched.

Gathering is a collective: with several processes, every process must ask for the state dict together
(the same rule accelerate states for ``get_state_dict`` under ZeRO-3), except for what read_alone.py
keeps for a read on the main process alone.
"""

import torch

from . import read_alone
from .partitioned import copied_by_hook, is_partitioned, shards


def _host_copy(param):
    if not is_partitioned(param):
        return param.detach().to("cpu", copy=True)
    import deepspeed

    with deepspeed.zero.GatheredParameters(shards([param]), modifier_rank=None):
        return param.data.detach().to("cpu", copy=True)


def _separate_full_tensors(module, state_dict, prefix, local_metadata):
    if prefix:
        return None
    # One parameter at a time, each copied to the host: copying (or gathering) the whole model at once would put
    # a second full copy of its weights on the card (1.6 GiB for SD1.5's UNet in fp16), more than a 6 GB card has
    # left in training.
    # state_dict(keep_vars=True) holds the parameters themselves: that caller wants them, not copies.
    named = [(name, param) for name, param in module.named_parameters(remove_duplicate=False)
             if name in state_dict and state_dict[name] is not param and copied_by_hook(param)]
    # with several processes, what needs no collective now (a read on the main process alone)
    copies = read_alone.full_values(module, [param for _, param in named])
    for name, param in named:
        if id(param) not in copies:  # tied under several names: one copy, shared as the model shares it
            copies[id(param)] = _host_copy(param)
        state_dict[name] = copies[id(param)]
    return state_dict


def add_full_weight_hooks(models):
    """Make ``state_dict()`` of each merged model return full, separate tensors; idempotent."""
    for model in models:
        if not getattr(model, "_accel_ds_fix_gathers", False):  # a plain flag: the model may be pickled whole
            model._register_state_dict_hook(_separate_full_tensors)
            model._accel_ds_fix_gathers = True


def state_dict_for_saving(model):
    """The model's own keys, full tensors, cloned as accelerate clones them for saving (what the hook above
    copied to the host already is not copied again)."""
    state = model.state_dict()
    fresh = {n for n, p in model.named_parameters(remove_duplicate=False) if copied_by_hook(p)}
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) and k not in fresh else v for k, v in state.items()}


def load_full_weights(model, state_dict, *args, **kwargs):
    """``model.load_state_dict`` that also writes into ZeRO-3 shards: the parameters it names are gathered,
    written on the first process and partitioned again (a collective, like the gather for saving)."""
    partitioned = shards(p for n, p in model.named_parameters() if n in state_dict)
    if not partitioned:
        return model.load_state_dict(state_dict, *args, **kwargs)
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
        return model.load_state_dict(state_dict, *args, **kwargs)
