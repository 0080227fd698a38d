"""Host memory for a checkpoint's universal copy (universal_copy.py), checked before converting.

DeepSpeed's converter holds one process's optimizer states at a time (for an NVMe checkpoint, its optimizer file
with the swapped sub groups put back): about 12 bytes a trained parameter of that process, 10 GB for SD1.5's UNet.
A resume under another layout converts inside the training process, beside the run's own memory: kohya's SD1.5
state resumed under zero3-nvme peaked at 18.7 GiB (docs/gpu.md run 11), more than the 15 GB laptop that tier is
for has. Where the host has not the room, the conversion stops before it starts, naming the command that converts
on its own, instead of the kernel's OOM killer half-way. ACCEL_DS_FIX_MEMORY_CHECK (warn / off) applies here too.
"""

import os

from ...errors import CheckpointError
from ...memory import check as memory_check
from . import universal_copy

GIB = 2**30
# DeepSpeed 0.19.8's converter peaked at 1.16x the optimizer file it read, above the interpreter's own 0.25 GiB
# (convert-checkpoint of a 134M-parameter bf16 checkpoint, a 1.5 GiB file: 2.0 GiB at the peak); a margin on both.
STATES_FACTOR, INTERPRETER = 1.2, GIB // 2


def states_bytes(directory, tag):
    """The largest of the checkpoint's per-process optimizer states, as the converter holds them in memory: the
    optimizer file, and for an NVMe checkpoint that process's swap files (put back into it first)."""
    tag_dir = os.path.join(directory, tag)
    largest = 0
    for rank, path in universal_copy.optimizer_files(tag_dir).items():
        swapped = universal_copy.rank_swap_files(tag_dir, rank)
        size = os.path.getsize(path) + sum(os.path.getsize(p) for files in swapped.values() for p in files.values())
        largest = max(largest, size)
    return largest


def _needed_for(states):
    return int(states * STATES_FACTOR) + INTERPRETER


def needed(directory, tag):
    """Host memory the conversion takes at its peak, in bytes."""
    return _needed_for(states_bytes(directory, tag))


def _gib(nbytes):
    return f"{nbytes / GIB:.1f} GiB"


def check(directory, tag, in_run, available=None):
    """Raise CheckpointError (or warn, as ACCEL_DS_FIX_MEMORY_CHECK says) where converting ``directory`` would not
    fit the host memory ``available`` (default: what the kernel says is available now). ``in_run``: inside the
    training process that resumes (whose memory is already taken), else `convert-checkpoint` on its own."""
    mode = memory_check.check_mode()
    if mode == "off":
        return
    available = memory_check.available_host_bytes() if available is None else available
    if available is None:  # no /proc: nothing to compare with
        return
    states = states_bytes(directory, tag)
    need = _needed_for(states)
    if need <= available:
        return
    head = (f"accel_ds_fix: converting {directory} to DeepSpeed's universal checkpoint format needs about "
            f"{_gib(need)} of host memory (DeepSpeed's converter holds one process's optimizer states at once, "
            f"{_gib(states)} here), and {_gib(available)} are available")
    tag_option = "" if tag == "pytorch_model" else f" --tag {tag}"
    if in_run:
        message = (
            f"{head} beside this run. Nothing was loaded; the checkpoint is unchanged. Stop the run and convert it "
            f"on its own first: `python -m accel_ds_fix convert-checkpoint {directory}{tag_option}` writes the copy "
            f"beside the checkpoint, and the resume then takes it without converting. Set "
            f"{memory_check.ENV}=warn to try here anyway.")
    else:
        message = (
            f"{head}. Nothing was written. Close what else holds memory, or convert on a machine with more and "
            f"copy the folder {universal_copy.converted_path(directory)} beside the checkpoint here (the resume "
            f"takes it when the checkpoint's content matches). Set {memory_check.ENV}=warn to try anyway.")
    memory_check.stop_or_warn(mode, message, CheckpointError)
