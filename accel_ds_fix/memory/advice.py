"""`python -m accel_ds_fix plan`: every shipped tier's predicted GPU, host and disk needs for a model on a
machine, whether each fits, and the one to use. Parameter counts come from a number or from a model folder,
read without loading any weights."""

import dataclasses
import glob
import json
import os
import re
import struct

from ..nvme import disk_speed
from ..nvme import prerequisites as nvme_prerequisites
from . import model as memory_model
from .tiers import DEFAULT_NVME_PATH, TIERS

GIB = memory_model.GIB
# Kept free of the training: the CUDA context and the display on the card, the system and desktop in RAM
# (a 15 GB laptop leaves about 12 GB to the training).
GPU_RESERVE = int(0.5 * GIB)
HOST_RESERVE = 3 * GIB
# What DreamBooth-style scripts pass to prepare() from a diffusers pipeline folder.
TRAINED_COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}
_BYTES = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_count(text):
    """'983M', '1.1B', '860000000' -> a number of parameters."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmbg]?)\s*", str(text).lower())
    if not match:
        raise ValueError(f"not a parameter count: {text!r} (examples: 983M, 1.1B, 860000000)")
    try:
        return int(float(match.group(1)) * _UNITS[match.group(2)])
    except (OverflowError, ValueError):  # "1..2", or more digits than a float holds
        raise ValueError(f"not a parameter count: {text!r} (examples: 983M, 1.1B, 860000000)") from None


def parse_bytes(text):
    """'6GiB', '16 GB', '6g' -> bytes (a bare G means GiB, as in nvidia-smi and free -g)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in _BYTES:
        raise ValueError(f"not a memory size: {text!r} (examples: 6GiB, 16GB, 12g)")
    try:
        return int(float(match.group(1)) * _BYTES[match.group(2)])
    except (OverflowError, ValueError):
        raise ValueError(f"not a memory size: {text!r} (examples: 6GiB, 16GB, 12g)") from None


def _safetensors_numel(path):
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    total = 0
    for key, info in header.items():
        if key != "__metadata__":
            n = 1
            for dim in info["shape"]:
                n *= dim
            total += n
    return total


def _folder_numel(folder):
    files = glob.glob(os.path.join(folder, "*.safetensors"))
    if files:
        return sum(_safetensors_numel(f) for f in files)
    files = glob.glob(os.path.join(folder, "*.bin"))
    if files:
        import torch

        return sum(t.numel() for f in files for t in torch.load(f, mmap=True, weights_only=True).values())
    raise ValueError(f"no weights (*.safetensors or *.bin) in {folder}")


def count_model_dir(path, components=TRAINED_COMPONENTS):
    """Parameters of a model folder: a diffusers pipeline (the components a DreamBooth script trains), a
    single diffusers or transformers model, or one .safetensors file. Only file headers are read."""
    if os.path.isfile(path):
        return {os.path.basename(path): _safetensors_numel(path)}
    if os.path.exists(os.path.join(path, "model_index.json")):
        found = {c: _folder_numel(os.path.join(path, c)) for c in components if os.path.isdir(os.path.join(path, c))}
        if not found:
            raise ValueError(f"{path} is a diffusers pipeline without any of {', '.join(components)}")
        return found
    return {os.path.basename(os.path.normpath(path)): _folder_numel(path)}


@dataclasses.dataclass
class Machine:
    gpu: int  # bytes of the card (nvidia-smi's total)
    host: int  # bytes of RAM
    gpu_usable: int
    host_usable: int

    @classmethod
    def given(cls, gpu=None, host=None):
        if gpu is None:
            gpu = _detected_gpu()
        if host is None:
            host = _detected_host()
        return cls(gpu, host, max(0, gpu - GPU_RESERVE) if gpu else 0, max(0, host - HOST_RESERVE) if host else 0)


def _detected_gpu():
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
    except ImportError:
        pass
    return None


def _detected_host():
    from .check import _meminfo

    return _meminfo("MemTotal")


def _can_run_here(config, prediction, checkpoint, world_size):
    """(reasons it cannot run on this machine, notes): NVMe prerequisites and disk room; none for other tiers."""
    cannot = nvme_prerequisites.problems(config)
    errors, notes = nvme_prerequisites.room_problems(config, prediction.nvme, checkpoint, world_size)
    return cannot + errors, notes


def plan(work, machine, mixed_precision="fp16", world_size=1, nvme_path=DEFAULT_NVME_PATH):
    """One row per tier, fastest first, and the name of the first that fits and can run here (or None)."""
    rows = []
    for tier in TIERS:
        config = tier.deepspeed_config(nvme_path)
        settings = memory_model.Settings.from_config(config, mixed_precision, world_size)
        p = memory_model.predict(work, settings, "cuda")
        ram_gib = settings.nvme_ram / GIB if settings.nvme_ram else None
        if ram_gib and machine.host_usable and p.host > machine.host_usable:
            # the NVMe tier's sub groups kept in RAM: as much of the shipped amount as this host leaves
            without = memory_model.predict(work, dataclasses.replace(settings, nvme_ram=0), "cuda")
            ram_gib = min(ram_gib, max(0, machine.host_usable - without.host) // (GIB // 4) / 4)
            config = tier.deepspeed_config(nvme_path, ram_gib)
            settings = dataclasses.replace(settings, nvme_ram=int(ram_gib * GIB))
            p = memory_model.predict(work, settings, "cuda")
        fits_gpu = bool(machine.gpu_usable) and p.gpu_reserved <= machine.gpu_usable
        fits_host = bool(machine.host_usable) and p.host <= machine.host_usable
        checkpoint = memory_model.checkpoint_bytes(work, settings)
        cannot, notes = _can_run_here(config, p, checkpoint, world_size)
        rows.append({
            "tier": tier.name,
            "title": tier.title,
            "gpu_reserved_gib": round(p.gpu_reserved / GIB, 2),
            "host_gib": round(p.host / GIB, 2),
            "nvme_gib": round(p.nvme / GIB, 2),
            "checkpoint_gib": round(checkpoint / GIB, 2),
            "nvme_optimizer_ram_gib": ram_gib,
            "trained_in_ram": memory_model.kept_in_ram(work, settings)[0] * world_size,
            "fits_gpu": fits_gpu,
            "fits_host": fits_host,
            "fits": fits_gpu and fits_host,
            "can_run_here": not cannot,
            "cannot_run_here": "; ".join(cannot) or None,
            "notes": notes,
            "caveat": tier.caveat,
            "parts": [{"what": w, "where": where, "gib": round(b / GIB, 3)} for w, where, b in p.parts],
        })
    recommended = next((r["tier"] for r in rows if r["fits"] and r["can_run_here"]), None)
    return rows, recommended


def nvme_step_times(work, speed, compute_seconds, steps=None, settings=None, accumulations=(1, 2, 4)):
    """The NVMe tier's predicted time per optimizer step with gradient accumulation 1, 2, 4 on a measured disk:
    ``settings`` (the tier's; pipelined or not, and the sub groups it keeps in RAM) decide what the disk moves."""
    settings = settings or memory_model.Settings(stage=3, offload_optimizer="nvme", pipelined=True)
    kept, _ = memory_model.kept_in_ram(work, settings)
    swapped = work.trainable - kept * settings.world_size
    rows = []
    for k in accumulations:
        t = disk_speed.predict(swapped, speed, k, compute_seconds, pipelined=settings.pipelined)
        rows.append({"gradient_accumulation": k, "seconds_per_step": round(t.seconds, 1),
                     "disk_seconds": round(t.disk_seconds, 1), "compute_seconds": round(t.compute_seconds, 1),
                     "hours": round(steps * t.seconds / 3600, 1) if steps else None,
                     "disk_written_gb": round(steps * t.bytes_written / 1e9) if steps else None,
                     "written_per_step_gb": round(t.bytes_written / 1e9, 1)})
    return rows
