"""ZeRO-1/2 with the optimizer on the host: the step's per-tensor values read back to the host at once.

DeepSpeed 0.19.8 checks each trained tensor's gradient for inf/NaN in the backward (`update_offload_overflow_tracker`:
`if has_inf_or_nan(grad)`, a wait for the card per tensor) and reads each tensor's gradient norm with its own
`.item()` in the step. With a LoRA's hundreds of small tensors the card idles at every one of these waits: about
0.45 ms a trained tensor on an H100 (docs/gpu.md runs 19-20), more than the copies of the streaming tier. Here the
flags are OR-ed on the card and read once where DeepSpeed asks for the overflow, and the norms are copied to the
host in one transfer: the same values, so the same overflow decision, norm, clipping and step, bit for bit.
"""

import torch

_PENDING = "_accel_ds_fix_pending_overflow"


def update_overflow_tracker(wrapped, instance, args, kwargs):
    """DeepSpeedZeroOptimizer.update_offload_overflow_tracker(grad): the flag kept on the card, no wait."""
    grad = args[0] if args else kwargs.get("grad")
    if grad is None:
        return None
    flag = instance._has_inf_or_nan(grad.data)
    if not isinstance(flag, torch.Tensor):  # a release that returns a bool already waited: keep its meaning
        if flag:
            instance.local_overflow = True
        return None
    pending = instance.__dict__.get(_PENDING)
    setattr(instance, _PENDING, flag if pending is None else pending | flag)
    return None


def resolve_overflow(wrapped, instance, args, kwargs):
    """has_overflow / reset_cpu_buffers: the flags gathered since the last read, read now (one wait)."""
    pending = instance.__dict__.pop(_PENDING, None)
    if pending is not None and bool(pending):
        instance.local_overflow = True
    return wrapped(*args, **kwargs)


def norms_read_once(wrapped, instance, args, kwargs):
    """complete_grad_norm_calculation_for_cpu_offload(params): every norm on the host in one copy."""
    norms = instance.norm_for_param_grads
    if not norms or not all(isinstance(n, torch.Tensor) and n.dim() == 0 for n in norms.values()):
        return wrapped(*args, **kwargs)
    keys = list(norms)
    values = torch.stack([norms[k] for k in keys]).cpu()
    instance.norm_for_param_grads = dict(zip(keys, values.unbind()))
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.norm_for_param_grads = norms
