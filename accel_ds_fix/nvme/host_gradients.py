"""ZeRO-3 with the optimizer on NVMe: the step takes its fp32 gradients from host memory, not from a round trip
through the disk.

DeepSpeed (0.19.8) writes each sub group's gradient partition to the swap folder at the accumulation boundary
and reads it back when the step swaps that sub group in (DeepSpeed issue 3673): 8 of the 32 bytes per trained
parameter that each optimizer step moves through the disk. The same values already sit in host memory, in
ZeRO-3's gradient partition buffer (on the host under optimizer offload), until the next backward overwrites
them after the step. DeepSpeed's swapper has a path for gradients it keeps in memory (its "unswapped"
gradients, for tensors too small to swap), which converts them to fp32 as it copies them into the step's
buffer: the patch hands it views of that host buffer. The disk then moves 24 bytes a parameter (the fp32
weights and Adam states, in and out), with the same values in the step, and no host memory is added.

``ACCEL_DS_FIX_NVME_GRADIENTS=disk`` keeps DeepSpeed's own behaviour. Applied to the DeepSpeed releases in
``versions.NVME_GRADIENTS_IN_RAM`` only, whose code it was written against.
"""

import logging
import os

from .. import notices, versions

ENV = "ACCEL_DS_FIX_NVME_GRADIENTS"
# The name-mangled attribute of DeepSpeedZeroOptimizer_Stage3 that maps a parameter's ds_id to its gradient
# partition in the host buffer.
_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


def enabled():
    value = os.environ.get(ENV, "host").strip().lower()
    if value not in ("host", "disk"):
        notices.say(f"{ENV}={value!r} is not understood: use host (the default) or disk; keeping them in host memory.",
                    level=logging.WARNING, once_key=ENV)
    return value != "disk" and versions.in_range("deepspeed", versions.NVME_GRADIENTS_IN_RAM)


def _applies(optimizer, sub_group):
    return (enabled() and getattr(optimizer, "swap_optimizer", False) and hasattr(optimizer, _PARTITIONS)
            and optimizer._swappable_optimizer_subgroup(sub_group))


def _boundary_args(param, grad_buffer, offload_fp32_gradients, offload_fp32_offsets):
    return param, grad_buffer, offload_fp32_gradients, offload_fp32_offsets


def _swap_out_args(offload_fp32_gradients, offload_fp32_offsets):
    return offload_fp32_gradients, offload_fp32_offsets


def keep_on_host(wrapped, instance, args, kwargs):
    """DeepSpeedZeroOptimizer_Stage3._offload_grad_partition_at_boundary: for a sub group on NVMe, collect the
    host partition itself instead of an fp32 copy of it on the device, which DeepSpeed would write to disk."""
    param, grad_buffer, gradients, offsets = _boundary_args(*args, **kwargs)
    param_id = instance.get_param_id(param)
    sub_group, dest_offset, _ = instance.grad_position[param_id]
    if not _applies(instance, sub_group):
        return wrapped(*args, **kwargs)
    instance.norm_for_param_grads[param_id] = instance._constant_buffered_norm2(grad_buffer)
    host_partition = getattr(instance, _PARTITIONS)[param.ds_id].narrow(0, 0, grad_buffer.numel())
    gradients.setdefault(sub_group, []).append(host_partition)
    offsets.setdefault(sub_group, []).append(dest_offset)
    return None


def hand_to_swapper(wrapped, instance, args, kwargs):
    """DeepSpeedZeroOptimizer_Stage3._swap_out_offload_fp32_gradients: register the host partitions as gradients
    the swapper keeps in memory; the step's swap-in copies them into its fp32 buffer."""
    gradients, offsets = _swap_out_args(*args, **kwargs)
    # keep_on_host decided per sub group by the same test, so a call's gradients are all host views or none are.
    if not gradients or not all(_applies(instance, i) for i in gradients):
        return wrapped(*args, **kwargs)
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()  # the host partitions were filled by non-blocking copies from the device
    for sub_group, tensors in gradients.items():
        swap_info = instance.optimizer_swapper._get_param_swap_info(instance.fp32_partitioned_groups_flat[sub_group])
        if swap_info is not None:
            swap_info.unswapped_gradients.update(zip(offsets[sub_group], tensors))
    return None
