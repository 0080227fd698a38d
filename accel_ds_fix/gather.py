"""Full weights from a ZeRO-3 engine, where each parameter outside forward is only a shape-[0] shard.

A state_dict hook on every merged model gathers its parameters whenever ``model.state_dict()`` is called on
the model itself (``unwrap_model(m).state_dict()``, ``save_pretrained``, ``get_state_dict(m)``), so a script
never writes empty weights. DeepSpeed's own checkpointing calls ``state_dict()`` on the merged module, which
reaches each model with a non-empty prefix: those calls are left to DeepSpeed untouched.

Gathering is a collective: with several processes, every process must ask for the state dict together
(the same rule accelerate states for ``get_state_dict`` under ZeRO-3).
"""

import torch


def is_partitioned(param):
    return hasattr(param, "ds_id")


def shards(params):
    """The partitioned parameters that are shards now (not gathered already by an outer GatheredParameters,
    whose own exit must be the one to partition them again)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [p for p in params if is_partitioned(p) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def full_numel(param):
    """The parameter's full number of elements, also when ZeRO-3 holds only a shard of it here."""
    return param.ds_numel if is_partitioned(param) else param.numel()


def _gather_full_weights(module, state_dict, prefix, local_metadata):
    if prefix:
        return None
    named = [(n, p) for n, p in module.named_parameters(remove_duplicate=False) if n in state_dict]
    partitioned = list({id(p): p for _, p in named if is_partitioned(p)}.values())
    if not partitioned:
        return None
    import deepspeed

    # One parameter at a time, each copied to the host: gathering the whole model at once would put a second full
    # copy of its weights on the card (1.6 GiB for SD1.5's UNet in fp16), more than a 6 GB card has left in training.
    for name, param in named:
        if is_partitioned(param):
            with deepspeed.zero.GatheredParameters(shards([param]), modifier_rank=None):
                state_dict[name] = param.data.detach().to("cpu", copy=True)
    return state_dict


def add_full_weight_hooks(models):
    """Make ``state_dict()`` of each ZeRO-3-partitioned model return full tensors; idempotent."""
    for model in models:
        if not getattr(model, "_accel_ds_fix_gathers", False) and any(is_partitioned(p) for p in model.parameters()):
            model._register_state_dict_hook(_gather_full_weights)
            model._accel_ds_fix_gathers = True


def state_dict_for_saving(model):
    """The model's own keys, full tensors, cloned (no views into flat DeepSpeed buffers; under ZeRO-3 the hook
    above already gave host copies)."""
    state = model.state_dict()  # gathered by the hook above under ZeRO-3
    fresh = {n for n, p in model.named_parameters(remove_duplicate=False) if is_partitioned(p)}
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
