"""`python -m accel_ds_fix plan`: every shipped tier's predicted GPU, host and disk needs for a model on a
machine, whether each fits, and the one to use. Parameter counts come from a number or from a model folder,
read without loading any weights."""

import dataclasses
import os
import re

from ..deepspeed_config import STREAM_ALLOCATOR_SLACK
from ..nvme import disk_speed
from ..nvme import prerequisites as nvme_prerequisites
from . import model as memory_model
from . import model_files, pipelines
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


def count_model_dir(path, components=TRAINED_COMPONENTS):
    """Parameters of a model folder: a diffusers pipeline (the components a DreamBooth script trains), a
    single diffusers or transformers model, or one .safetensors file. Only file headers are read."""
    if os.path.isfile(path):
        return {os.path.basename(path): _numel(model_files.file_shapes(path))}
    if os.path.exists(os.path.join(path, "model_index.json")):
        found = {c: _numel(model_files.folder_shapes(os.path.join(path, c)))
                 for c in components if os.path.isdir(os.path.join(path, c))}
        if not found:
            raise ValueError(f"{path} is a diffusers pipeline without any of {', '.join(components)}")
        return found
    return {os.path.basename(os.path.normpath(path)): _numel(model_files.folder_shapes(path))}


def _numel(shapes):
    return sum(model_files.numel(s) for s in shapes.values())


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


# The card's host-to-card copy bandwidth from pinned memory where `plan --h2d-gbps` gives none: a PCIe 4.0 x16 slot
# in practice (bench/h2d_bandwidth.py measures a machine's: 53 GB/s on an H100 host, PCIe 5.0).
DEFAULT_H2D_GBPS = 20.0


def _frozen_on_card(work, settings, machine):
    """The streaming tier: GiB of frozen weights the card keeps beside everything else (in quarters of a GiB),
    all of them where they fit; as the run's own choice without a number (streaming/engine_build.py), at least
    card_reserve_gib stays free for activations and the step's temporaries (the family's activation estimate is
    at its usual resolution: 1024 px needs more)."""
    least = memory_model.predict(work, dataclasses.replace(settings, frozen_on_card=0), "cuda")
    # what the caching allocator keeps beside the allocated comes off the card first, as in the run
    usable = int(machine.gpu_usable / STREAM_ALLOCATOR_SLACK)
    room = max(0, usable - least.gpu_allocated - max(0, settings.card_reserve - work.activations))
    frozen = settings.half_bytes * (work.params - work.trainable) + work.frozen_on_gpu
    if room >= frozen:  # all of them: rounded up, so that none streams for a rounding
        return -(-frozen // (GIB // 4)) / 4
    return room // (GIB // 4) / 4


def plan(work, machine, mixed_precision="fp16", world_size=1, nvme_path=DEFAULT_NVME_PATH, here=True,
         h2d_gbps=DEFAULT_H2D_GBPS, compute_seconds=None):
    """One row per tier, fastest first, and the name of the first that fits and can run here (or None).
    ``here``: False for a machine on paper (the grid): this machine's libaio and disk are not asked.
    ``h2d_gbps``: the card's copy bandwidth from pinned host memory, ``compute_seconds``: the same script's step on
    a card that holds the whole model, for the streaming tier's step."""
    rows = []
    for tier in TIERS:
        config = tier.deepspeed_config(nvme_path)
        settings = memory_model.Settings.from_config(config, mixed_precision, world_size)
        on_card_gib = None
        if settings.stream:
            on_card_gib = _frozen_on_card(work, settings, machine)
            config = tier.deepspeed_config(nvme_path, frozen_on_card_gib=on_card_gib)
            settings = dataclasses.replace(settings, frozen_on_card=int(on_card_gib * GIB))
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
        # a run that resumes holds its training buffers and what load_state reads (memory/model.py resume_extra)
        fits_host = bool(machine.host_usable) and max(p.host, p.host_resume) <= machine.host_usable
        checkpoint = memory_model.checkpoint_bytes(work, settings)
        cannot, notes = _can_run_here(config, p, checkpoint, world_size) if here else ([], [])
        stream = memory_model.stream_split(work, settings) if settings.stream else None
        step = host_bound = None
        if stream is not None and stream.streamed:
            copies = stream.per_step / (h2d_gbps * 1e9)
            if compute_seconds:
                step, unhidden = memory_model.stream_step(stream, h2d_gbps * 1e9, compute_seconds)
                when = (f"with --compute-seconds {compute_seconds:g}, about {step:.2f} s a step: {unhidden:.2f} s of "
                        f"copies that the computation does not hide")
                if work.trained_tensors:
                    host_bound = memory_model.host_bound_step(work, step)
                    when += (f"; up to {host_bound:.2f} s where the host, not the card, bounds the step (measured so "
                             f"on an H100 at 512 px, and for SD3.5-large and SDXL at 1024 px: ZeRO-2's own work for "
                             f"each of the {work.trained_tensors} trained tensors, about "
                             f"{memory_model.OFFLOAD_HOST_SECONDS_PER_TENSOR * 1e3:.2f} ms each)")
            else:
                when = ("a step takes its computation and the part of the copies it does not hide (--compute-seconds "
                        "S, the same script's step on a card that holds it all, gives the step)")
            notes = notes + [
                f"streams {stream.streamed / GIB:.1f} GiB of frozen weights from pinned host memory, keeps "
                f"{stream.kept / GIB:.1f} GiB on the card (first the text encoders, then the models the script keeps "
                f"beside them, T5 and the VAE, then the denoiser's first blocks): {stream.per_step / GIB:.1f} GiB "
                f"cross each step (the prepared models' twice, for the forward and the backward), {copies:.2f} s at "
                f"{h2d_gbps:g} GB/s (--h2d-gbps); {when}"]
        rows.append({
            "tier": tier.name,
            "title": tier.title,
            "gpu_reserved_gib": round(p.gpu_reserved / GIB, 2),
            "host_gib": round(p.host / GIB, 2),
            "host_resume_gib": round(p.host_resume / GIB, 2),
            "nvme_gib": round(p.nvme / GIB, 2),
            "checkpoint_gib": round(checkpoint / GIB, 2),
            "nvme_optimizer_ram_gib": ram_gib,
            "trained_in_ram": memory_model.kept_in_ram(work, settings)[0] * world_size,
            "frozen_on_card_gib": on_card_gib,
            "streamed_gib": round(stream.streamed / GIB, 2) if stream else 0,
            "streamed_per_step_gib": round(stream.per_step / GIB, 2) if stream else 0,
            "copy_seconds_per_step": round(stream.per_step / (h2d_gbps * 1e9), 2) if stream else 0,
            "stream_step_seconds": round(step, 2) if step else None,
            "stream_step_host_bound_seconds": round(host_bound, 2) if host_bound else None,
            "fits_gpu": fits_gpu,
            "fits_host": fits_host,
            "fits_host_training": bool(machine.host_usable) and p.host <= machine.host_usable,
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


@dataclasses.dataclass(frozen=True)
class Described:
    """A model as `plan` counts it: the workload, and the words that say where the numbers came from."""

    work: memory_model.Workload
    source: str
    family: object = None  # pipelines.Family of a pipeline folder, else None
    frozen: tuple = ()  # (component, bytes) the script keeps on the card outside prepare()


def describe_model(path, train_text_encoder=True, lora_rank=0, mixed_precision="fp16", activations=None,
                   resolution=None):
    """The workload of training the model at ``path`` as its scripts do. A Flux, SD3/SD3.5, SDXL or SD1.x
    pipeline folder is counted per component (``train_text_encoder``, ``lora_rank``: the scripts' flags); other
    folders and files count every parameter as trained. ``activations``: bytes, or None for the family's
    estimate (SD1.5's measured figure elsewhere) at ``resolution`` (pixels a side; None: the family's usual one),
    which grows with the latent's tokens, the square of the side (SD3.5-large's LoRA: 3.6 GiB measured at 1024 px,
    the family's 1.0 at 512 scaled to 4.0; docs/gpu.md run 19)."""
    family = None
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "model_index.json")):
        family = pipelines.family_of(path)
    if family is None:
        if lora_rank:
            raise ValueError(f"--lora-rank needs a diffusers pipeline folder of a known family (Flux, SD3/SD3.5, "
                             f"SDXL, SD1.x); {path} is not one: give --trainable instead")
        counted = count_model_dir(path)
        params = sum(counted.values())
        work = memory_model.Workload(params=params, trainable=params,
                                     largest_trainable=min(params, memory_model.SD15_LARGEST_TENSOR),
                                     activations=memory_model.SD15_ACTIVATIONS if activations is None else activations)
        return Described(work, ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in counted.items()))
    c = pipelines.count(path, family, train_text_encoder, lora_rank, mixed_precision)
    work = memory_model.Workload(params=c.params, trainable=c.trainable, largest_trainable=c.largest_trainable,
                                 largest_weight=c.largest_weight, weight_bytes=c.weight_bytes, frozen_on_gpu=c.frozen_on_gpu,
                                 moved_before_prepare=c.moved_before_prepare, loaded_bytes=c.loaded_bytes,
                                 largest_block=c.largest_block, frozen_smaller_prepared=c.frozen_smaller_prepared,
                                 trained_tensors=c.trained_tensors,
                                 activations=_activations(family, resolution) if activations is None else activations)
    how = f"LoRA rank {lora_rank}" if lora_rank else "full fine-tune"
    encoders = "with its text encoder(s)" if train_text_encoder else "text encoders frozen"
    return Described(work, f"{c.describe()}; {how}, {encoders}", family, c.frozen_what)


def _activations(family, resolution):
    if not resolution:
        return family.activations
    return int(family.activations * (resolution / family.resolution) ** 2)


def _closest(rows):
    """Where no tier fits: the one with the least host memory among those the card holds, else the one that needs
    the least of the card."""
    on_card = [r for r in rows if r["fits_gpu"]]
    if on_card:
        return min(on_card, key=lambda r: max(r["host_gib"], r["host_resume_gib"]))
    return min(rows, key=lambda r: r["gpu_reserved_gib"])


# The grid `plan --grid` prints: consumer cards and RAM sizes of the people who train these models.
GRID_CARDS_GB = (8, 12, 16, 24)
GRID_HOSTS_GB = (16, 32, 64)


def grid(work, mixed_precision="bf16", world_size=1, nvme_path=DEFAULT_NVME_PATH, h2d_gbps=DEFAULT_H2D_GBPS):
    """For each card and RAM size of the grid (a "24 GB" card and "64 GB" of RAM hold 24 and 64 GiB, as nvidia-smi
    and free count them; less the reserves): the recommended tier's row, or None where no tier fits."""
    cells = []
    for card in GRID_CARDS_GB:
        for host in GRID_HOSTS_GB:
            machine = Machine.given(card * GIB, host * GIB)
            rows, recommended = plan(work, machine, mixed_precision, world_size, nvme_path, here=False, h2d_gbps=h2d_gbps)
            row = next((r for r in rows if r["tier"] == recommended), None)
            cells.append({"card_gb": card, "ram_gb": host, "tier": recommended, "row": row,
                          "closest": None if row else _closest(rows)})
    return cells
