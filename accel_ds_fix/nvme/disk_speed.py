"""How long a step of the NVMe tier takes on this disk: the folder's direct-I/O read and write speed, measured
with DeepSpeed's own async I/O handle as the tier configures it (a few seconds; the files are deleted), and the
step time that follows from the bytes each optimizer step moves.

A ZeRO-3 step with the optimizer on NVMe swaps each sub group in (fp32 weights and Adam's two states: 12 bytes
a trained parameter), steps it on the CPU and swaps it out again, one sub group after another, so the disk's
time adds to the rest of the step. DeepSpeed alone also writes and reads the fp32 gradients (4 bytes each way);
the fix keeps those in host memory (host_gradients.py).
"""

import dataclasses
import os
import time

from . import host_gradients

GB = 1e9
STATE_BYTES = 12  # fp32 master weight + exp_avg + exp_avg_sq, per trained parameter, read and written each step
GRADIENT_BYTES = 4  # fp32 gradient, written and read back when DeepSpeed swaps it
# The time of one optimizer step outside the disk, weights on the GPU: forward and backward of the batch and
# DeepSpeedCPUAdam over the parameters. SD1.5 at 512 px, batch 1, on an H200 with a 16-core host: the NVMe
# tier's step less its swap timers, 3.6 - 4.7 s (docs/gpu.md, run 8). A laptop GPU needs longer for forward and
# backward: --compute-seconds gives the machine's own figure (a step of any tier without the disk shows it).
DEFAULT_COMPUTE_SECONDS = 4.0


@dataclasses.dataclass(frozen=True)
class DiskSpeed:
    read: float  # bytes per second
    write: float
    folder: str

    def describe(self):
        return f"reads {self.read / GB:.2f} GB/s and writes {self.write / GB:.2f} GB/s with direct I/O"


def _handle(aio):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    op = AsyncIOBuilder().load(verbose=False)
    return op.aio_handle(aio.get("block_size", 1048576), aio.get("queue_depth", 8), aio.get("single_submit", False),
                         aio.get("overlap_events", True), aio.get("intra_op_parallelism", 1))


_PREFIX = ".accel_ds_fix_speed_"


def _remove_leftovers(folder):
    """Files of a measurement whose process is gone (killed halfway): hundreds of MB each, never read again."""
    for name in os.listdir(folder):
        if name.startswith(_PREFIX):
            pid = int(name[len(_PREFIX):].split("_")[0])
            if not os.path.exists(f"/proc/{pid}"):
                os.unlink(os.path.join(folder, name))


def measure(folder, aio=None, file_bytes=200 * 1024**2, files=3):
    """Write then read ``files`` files of ``file_bytes`` in ``folder`` (a sub group's fp32 weights and two Adam
    states, as the tier swaps them), through DeepSpeed's async I/O with the tier's settings."""
    import torch

    from ..ops import libaio

    libaio.activate()
    handle = _handle(aio or {})
    os.makedirs(folder, exist_ok=True)
    _remove_leftovers(folder)
    paths = [os.path.join(folder, f"{_PREFIX}{os.getpid()}_{i}.swp") for i in range(files)]
    # Page-locked as the tier's swap buffers are: by CUDA where there is a GPU, else by DeepSpeed's own manager.
    if torch.cuda.is_available():
        buffers = [torch.empty(file_bytes // 4, dtype=torch.float32).pin_memory() for _ in paths]
        free = lambda buffer: None  # noqa: E731
    else:
        buffers = [handle.new_cpu_locked_tensor(file_bytes // 4, torch.empty(0, dtype=torch.float32)) for _ in paths]
        free = handle.free_cpu_locked_tensor
    try:
        for b in buffers:
            b.uniform_()  # not zeros: some SSDs compress
        started = time.perf_counter()
        for buffer, path in zip(buffers, paths):
            assert handle.async_pwrite(buffer, path, 0) == 0
        handle.wait()
        os.sync()
        written = time.perf_counter() - started
        started = time.perf_counter()
        for buffer, path in zip(buffers, paths):
            assert handle.async_pread(buffer, path, 0) == 0
        handle.wait()
        read = time.perf_counter() - started
    finally:
        for buffer in buffers:
            free(buffer)
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
    total = file_bytes * files
    return DiskSpeed(read=total / read, write=total / written, folder=folder)


@dataclasses.dataclass(frozen=True)
class StepTime:
    accumulation: int
    disk_seconds: float
    compute_seconds: float
    bytes_read: int
    bytes_written: int

    @property
    def seconds(self):
        return self.disk_seconds + self.compute_seconds


def predict(trainable, speed, accumulation=1, compute_seconds=DEFAULT_COMPUTE_SECONDS, gradients_in_ram=None):
    """One optimizer step (``accumulation`` batches) of the NVMe tier training ``trainable`` parameters. The time
    outside the disk is counted once per batch: an upper bound, since Adam runs once per step."""
    if gradients_in_ram is None:
        gradients_in_ram = host_gradients.enabled()
    per_param = STATE_BYTES + (0 if gradients_in_ram else GRADIENT_BYTES)
    moved = per_param * trainable
    return StepTime(accumulation=accumulation, disk_seconds=moved / speed.read + moved / speed.write,
                    compute_seconds=compute_seconds * accumulation, bytes_read=moved, bytes_written=moved)
