"""Host memory for DeepSpeed's own load of a checkpoint in the layout that saved it, checked before loading.

DeepSpeed (0.19.8, engine._get_all_zero_checkpoint_state_dicts) reads this process's ZeRO file whole with
torch.load, beside the run's own buffers: the fp32 master weights and Adam's two states of its partition, 12 bytes
a trained parameter (11 GiB for SD1.5), on top of a training that already holds about as much under CPU optimizer
offload (memory/model.py resume_extra). Where the host has not that room the kernel's OOM killer ends the resume
half-way; this stops it first, with what to do. Under NVMe offload the fix maps the file instead
(nvme_resume.py), so nothing is checked there. ACCEL_DS_FIX_MEMORY_CHECK (warn / off) applies.
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
    size = os.path.getsize(path)
    if available is None or size <= available:
        return
    message = (
        f"accel_ds_fix: load_state reads {path} whole ({size / GIB:.1f} GiB: this process's fp32 master weights and "
        f"optimizer states; DeepSpeed loads it with torch.load) beside this run's memory, and {available / GIB:.1f} GiB "
        "are available. Nothing was loaded; the checkpoint is unchanged. Close what else holds memory, or resume on "
        "the zero3-nvme tier, which reads the states from the disk a piece at a time: convert the checkpoint first "
        f"with `python -m accel_ds_fix convert-checkpoint {directory}` (on its own, before the run). `python -m "
        f"accel_ds_fix plan` shows each tier's resume peak. Set {memory_check.ENV}=warn to try here anyway.")
    memory_check.stop_or_warn(mode, message, CheckpointError)
