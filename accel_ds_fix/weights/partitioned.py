"""What DeepSpeed made of a parameter: a ZeRO-3 shard (partitioned), a view into ZeRO-1/2's flat buffer, or a
whole tensor of its own. Imports nothing heavy: read at start-up by modules the patches load."""


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


def is_flat_view(param):
    """A whole parameter that is a view into a larger storage: what ZeRO-1/2 make of every trained parameter."""
    if is_partitioned(param):
        return False
    return param.untyped_storage().nbytes() > param.numel() * param.element_size()


def copied_by_hook(param):
    """Whether the state_dict hook below gives a fresh host copy of this parameter."""
    return is_partitioned(param) or is_flat_view(param)
