"""Host memory for DeepSpeed's own load of a checkpoint in the layout that saved it, checked before loading.

The fix maps this process's ZeRO file for DeepSpeed's load (mapped_load.py): the fp32 master weights are copied
into the run's own buffers, and Adam's two states of its partition (8 bytes a trained parameter, 7.3 GiB for
SD1.5) are copied out into memory of the process's own, as a fresh training's first step allocates them. Where the
host has not that room the kernel's OOM killer would end the resume half-way; this stops it first, with what to
do. Under NVMe offload the states stay on the disk (nvme_resume.py), so nothing is checked there.
ACCEL_DS_FIX_MEMORY_CHECK (warn / off) applies.
"""

import os

from ..errors import CheckpointError
from ..memory import check as memory_check
from .layout import change as layout_change

GIB = 2**30


def check(engine, directory, tag, available=None):
    """Raise CheckpointError (or warn) where this process's ZeRO file in ``directory`` would not fit the host
    memory ``available`` (default: MemAvailable now)."""
    mode = memory_check.check_mode()
    if mode == "off" or layout_change.of_engine(engine)["offload_optimizer"] == "nvme":
        return
    path = engine._get_zero_ckpt_name(directory, tag)
    if not os.path.isfile(path):
        return  # DeepSpeed's own message for a checkpoint without it
    available = memory_check.available_host_bytes() if available is None else available
    size = states_bytes(engine)
    if available is None or size <= available:
        return
    message = (
        f"accel_ds_fix: load_state copies this process's optimizer states ({size / GIB:.1f} GiB, as the training's "
        f"first step would allocate them) out of {path} (mapped, not read whole) beside this run's memory, and "
        f"{available / GIB:.1f} GiB are available. Nothing was loaded; the checkpoint is unchanged. Close what else "
        "holds memory, or resume on "
        "the zero3-nvme tier, which reads the states from the disk a piece at a time: convert the checkpoint first "
        f"with `python -m accel_ds_fix convert-checkpoint {directory}` (on its own, before the run). `python -m "
        f"accel_ds_fix plan` shows each tier's resume peak. Set {memory_check.ENV}=warn to try here anyway.")
    memory_check.stop_or_warn(mode, message, CheckpointError)


def states_bytes(engine):
    """Adam's two fp32 states of this process's partition: what the load copies out of the mapped file."""
    optimizer = engine.optimizer
    flat = getattr(optimizer, "single_partition_of_fp32_groups", None) or getattr(
        optimizer, "fp32_partitioned_groups_flat", None) or []
    return 8 * sum(int(p.numel()) for p in flat)
