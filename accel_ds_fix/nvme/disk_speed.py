"""How long a step of the NVMe tier takes on this disk: the folder's direct-I/O read and write speed, measured
with DeepSpeed's own async I/O handle as the tier configures it (a few seconds; the files are deleted), and the
step time that follows from the bytes each optimizer step moves.

A ZeRO-3 step with the optimizer on NVMe swaps each sub group in (fp32 weights and Adam's two states: 12 bytes
a trained parameter), steps it on the CPU and swaps it out again. One sub group after another, the disk's read
and write times add to the rest of the step; pipelined (the shipped tier: pipeline_read and pipeline_write),
the next sub group is read while the previous one is written and the current one steps, so the disk's time is
what it takes to read and write at once. DeepSpeed alone also writes and reads the fp32 gradients (4 bytes each
way); the fix keeps those in host memory (host_gradients.py).
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
    both: float = 0.0  # bytes read and written per second, reading and writing at once (0: not measured)

    def describe(self):
        both = f", {self.both / GB:.2f} GB/s reading and writing at once" if self.both else ""
        return f"reads {self.read / GB:.2f} GB/s and writes {self.write / GB:.2f} GB/s with direct I/O{both}"


# `plan --grid` without --nvme-path: a PCIe 3 NVMe SSD of the kind laptops and desktops have, reading and
# writing at once about as fast as the H200 host's ext4 disk measured (1.95 GB/s, docs/gpu.md run 11).
ASSUMED_NVME = DiskSpeed(read=2.0 * GB, write=2.0 * GB, folder="(assumed)", both=2.0 * GB)


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


def _submit(handle, op, buffers, paths):
    for buffer, path in zip(buffers, paths):
        assert getattr(handle, op)(buffer, path, 0) == 0


def _timed(handle, op, buffers, paths):
    started = time.perf_counter()
    _submit(handle, op, buffers, paths)
    handle.wait()
    return time.perf_counter() - started


def measure(folder, aio=None, file_bytes=200 * 1024**2, files=3):
    """Write then read ``files`` files of ``file_bytes`` in ``folder`` (a sub group's fp32 weights and two Adam
    states, as the tier swaps them), then read them while writing as many others, as the pipelined tier does,
    through DeepSpeed's async I/O with the tier's settings (one handle reads, another writes, as DeepSpeed's
    pipelined swapper has them)."""
    import torch

    from ..ops import libaio

    libaio.activate()
    reader, writer = _handle(aio or {}), _handle(aio or {})
    os.makedirs(folder, exist_ok=True)
    _remove_leftovers(folder)
    paths = [os.path.join(folder, f"{_PREFIX}{os.getpid()}_{i}.swp") for i in range(2 * files)]
    # Page-locked as the tier's swap buffers are: by CUDA where there is a GPU, else by DeepSpeed's own manager.
    if torch.cuda.is_available():
        buffers = [torch.empty(file_bytes // 4, dtype=torch.float32).pin_memory() for _ in paths]
        free = lambda buffer: None  # noqa: E731
    else:
        buffers = [writer.new_cpu_locked_tensor(file_bytes // 4, torch.empty(0, dtype=torch.float32)) for _ in paths]
        free = writer.free_cpu_locked_tensor
    try:
        for b in buffers:
            b.uniform_()  # not zeros: some SSDs compress
        first, second = slice(0, files), slice(files, 2 * files)
        written = _timed(writer, "async_pwrite", buffers[first], paths[first])
        os.sync()
        read = _timed(reader, "async_pread", buffers[first], paths[first])
        # At once: the first files read back while the others are written (each handle has its own I/O threads).
        started = time.perf_counter()
        _submit(writer, "async_pwrite", buffers[second], paths[second])
        _submit(reader, "async_pread", buffers[first], paths[first])
        reader.wait()
        writer.wait()
        both = time.perf_counter() - started
    finally:
        for buffer in buffers:
            free(buffer)
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
    total = file_bytes * files
    return DiskSpeed(read=total / read, write=total / written, folder=folder, both=2 * total / both)


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


def predict(trainable, speed, accumulation=1, compute_seconds=DEFAULT_COMPUTE_SECONDS, gradients_in_ram=None,
            pipelined=True):
    """One optimizer step (``accumulation`` batches) of the NVMe tier training ``trainable`` parameters. The time
    outside the disk is counted once per batch: an upper bound, since Adam runs once per step (and, pipelined,
    beside the disk)."""
    if gradients_in_ram is None:
        gradients_in_ram = host_gradients.enabled()
    per_param = STATE_BYTES + (0 if gradients_in_ram else GRADIENT_BYTES)
    moved = per_param * trainable
    if pipelined and speed.both:
        disk = 2 * moved / speed.both
    else:
        disk = moved / speed.read + moved / speed.write
    return StepTime(accumulation=accumulation, disk_seconds=disk, compute_seconds=compute_seconds * accumulation,
                    bytes_read=moved, bytes_written=moved)
