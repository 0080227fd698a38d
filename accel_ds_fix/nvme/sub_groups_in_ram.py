"""ZeRO-3 with the optimizer on NVMe: the last sub groups of each step kept in host memory, within a budget.

The NVMe tier's optimizer step is the disk's time: every swapped sub group's fp32 weights and Adam states are
read and written each step (24 bytes a trained parameter; SD1.5: 23.6 GB, 13 of a 17 s step on a disk doing
1.7 GB/s). DeepSpeed already keeps a sub group too small to swap in host memory and steps it there with the
same CPU Adam. This makes the last sub groups of the step that fit a host-memory budget such sub groups too: a
kept parameter holds 16 bytes of RAM (fp32 weight, two Adam states, and its fp32 gradient, pinned) and takes 24
bytes a step off the disk, with the same values in the step. Kept last, their Adam runs while the last swapped
sub group is still being written.

The budget is the DeepSpeed config's ``"accel_ds_fix": {"nvme_optimizer_ram_gib": G}`` (the shipped zero3-nvme
tier: 1.5); absent or 0, DeepSpeed's own behaviour. Which sub groups are kept depends only on the model and the
budget, so every process keeps the same ones; a checkpoint records them (checkpoints/layout/change.py), since
DeepSpeed's NVMe checkpoint stores swapped and kept sub groups in different files. Applied to the DeepSpeed
releases in ``versions.NVME_SUB_GROUPS_IN_RAM`` only.
"""

import logging
import math

from .. import notices, versions
from ..deepspeed_config import KEY, SECTION, budget_bytes
from ..lookup import optimizer_record

GIB = 1024**3
_budget_of_engine_being_built = [0]


def pinned_bytes(nbytes):
    """What torch's caching host allocator takes for a pinned buffer: rounded up to a power of two."""
    return 1 << math.ceil(math.log2(nbytes)) if nbytes > 0 else 0


def host_bytes(elements, pinned=True):
    """Host memory of a kept sub group of ``elements``: fp32 weights and two Adam states, an fp32 gradient."""
    return 12 * elements + (pinned_bytes(4 * elements) if pinned else 4 * elements)


def choose(sizes, swappable, budget, pinned=True):
    """Indices of the sub groups kept in RAM: from the last one back, each swappable one that still fits."""
    kept, spent = [], 0
    for index in reversed(range(len(sizes))):
        cost = host_bytes(sizes[index], pinned)
        if swappable[index] and spent + cost <= budget:
            kept.append(index)
            spent += cost
    return frozenset(kept)


def while_building(wrapped, instance, args, kwargs):
    """DeepSpeedEngine._configure_zero_optimizer: the ZeRO-3 optimizer built inside finds the config's budget."""
    _budget_of_engine_being_built[0] = budget_bytes(getattr(instance._config, "_param_dict", None) or {})
    try:
        return wrapped(*args, **kwargs)
    finally:
        _budget_of_engine_being_built[0] = 0


def _kept(optimizer, swappable):
    kept = optimizer_record(optimizer).sub_groups_in_ram
    if kept is None:
        budget = _budget_of_engine_being_built[0]
        kept = frozenset()
        if budget and not getattr(optimizer, "params_in_nvme_and_cpu", False):
            if versions.in_range("deepspeed", versions.NVME_SUB_GROUPS_IN_RAM):
                import torch

                sizes = [int(n) for n in optimizer.fp16_partitioned_groups_flat_numel]
                # pinned by CUDA's caching host allocator (a power of two); on a CPU, plain memory
                pinned = bool(getattr(optimizer, "offload_optimizer_pin_memory", False)) and torch.cuda.is_available()
                kept = choose(sizes, [swappable(i) for i in range(len(sizes))], budget, pinned)
            else:
                notices.say(
                    f"{SECTION}.{KEY} is set, but DeepSpeed {versions.installed_version('deepspeed')} is not a release "
                    f"this was tested with ({' - '.join(versions.NVME_SUB_GROUPS_IN_RAM)}): every sub group is "
                    "swapped to the disk, as DeepSpeed does.", level=logging.WARNING, once_key=KEY)
        optimizer_record(optimizer).sub_groups_in_ram = kept
    return kept


def swappable(wrapped, instance, args, kwargs):
    """DeepSpeedZeroOptimizer_Stage3._swappable_optimizer_subgroup: a kept sub group is not swapped."""
    result = wrapped(*args, **kwargs)
    if not result:
        return result
    sub_group = args[0] if args else kwargs["sub_group_id"]
    return sub_group not in _kept(instance, wrapped)


def kept_sub_groups(optimizer):
    """The indices of the sub groups ``optimizer`` keeps in RAM (sorted), [] where none."""
    record = optimizer_record(optimizer, create=False)
    return sorted((record.sub_groups_in_ram if record is not None else None) or ())
