"""The one reader of a DeepSpeed config. Every part of the package asks it, so that a section left out and one
set to null (JSON's null, YAML's ~) mean the same everywhere, and "auto" is read one way.

``Settings`` is what the memory model, the plan, prepare() and the checkpoints' layout read from a config; the
small functions answer single questions where a whole ``Settings`` is more than the caller has (before accelerate
filled the config's "auto" values).
"""

import dataclasses
import math
import numbers

from .errors import ConfigError

# The package's own section: the NVMe tier's host-memory budget for sub groups kept off the disk
# (nvme/sub_groups_in_ram.py), and the streaming tier's keys (streaming/).
SECTION, KEY = "accel_ds_fix", "nvme_optimizer_ram_gib"
STREAM, ON_CARD, RESERVE = "stream_frozen_weights", "frozen_on_card_gib", "card_reserve_gib"
_KEYS = (KEY, STREAM, ON_CARD, RESERVE)
GIB = 1024**3
# The streaming tier's room for activations and the step's temporaries where the config gives none ("auto"
# keeps this much of the card free of frozen weights): SD3.5-large's LoRA at 1024 px holds 3.6 GiB of them, SDXL's
# 3.1 (with its fp32 VAE's encode), and the caching allocator keeps 0.8 - 1.1 GiB reserved beside what is
# allocated; 3 GiB left SDXL's LoRA out of memory in an 8 GiB cap (docs/gpu.md run 19).
DEFAULT_CARD_RESERVE_GIB = 4.0
# Beside what the streaming tier allocates, the caching allocator keeps up to this much more reserved (blocks of
# several sizes loaded and released between activations: 1.07 - 1.08 measured at 1024 px for Flux.1-dev and
# SD3.5-large, 1.02 at 512 px, docs/gpu.md run 19); the card's budget for frozen blocks is the card over it.
STREAM_ALLOCATOR_SLACK = 1.08


def section(config, *path):
    """``config[path[0]][path[1]]...`` as a dict: {} where a section is missing, null or not a mapping."""
    for key in path:
        config = config.get(key) if isinstance(config, dict) else None
    return config if isinstance(config, dict) else {}


def zero_stage(config):
    """The ZeRO stage, 0 where the config has none (or "auto" that accelerate has not filled yet)."""
    stage = section(config, "zero_optimization").get("stage", 0)
    try:
        return int(stage)
    except (TypeError, ValueError):
        return 0


def offload_device(config, part):
    """Where ZeRO offloads ``part`` ("offload_optimizer" or "offload_param"): "none", "cpu" or "nvme"."""
    return str(section(config, "zero_optimization", part).get("device") or "none")


def nvme_folders(config):
    """The nvme_path of each part the config offloads to NVMe (optimizer states, parameters), "" where unset."""
    parts = ("offload_optimizer", "offload_param")
    return sorted({section(config, "zero_optimization", p).get("nvme_path") or "" for p in parts
                   if offload_device(config, p) == "nvme"})


def cpu_optimizer_forced(config):
    """Whether accelerate swaps the script's optimizer for DeepSpeed's CPU one: under optimizer offload, unless the
    config's zero_force_ds_cpu_optimizer is false."""
    return offload_device(config, "offload_optimizer") != "none" and config.get("zero_force_ds_cpu_optimizer", True)


def fp16_enabled(config):
    return section(config, "fp16").get("enabled") is True


def _ours(config):
    """The package's section, checked: ConfigError for a key it does not take (said before anything is allocated:
    prepare() checks the config first)."""
    ours = config.get(SECTION)
    if ours is None:
        return {}
    if not isinstance(ours, dict) or set(ours) - set(_KEYS):
        raise ConfigError(
            f"accel_ds_fix: the DeepSpeed config's {SECTION!r} section is {ours!r}; it takes {', '.join(map(repr, _KEYS))} "
            f"(GiB of host memory for optimizer sub groups kept off the NVMe disk; the streaming tier's switch, GiB "
            f"of frozen weights kept on the card and GiB kept free for activations), e.g. "
            f'"{SECTION}": {{"{KEY}": 1.5}} or {{"{STREAM}": true, "{ON_CARD}": "auto"}}. Nothing was allocated.'
        )
    return ours


def _gib_value(ours, key, default, what, auto=False):
    value = ours.get(key, default)
    also = ' or "auto"' if auto else ""
    if auto and value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"accel_ds_fix: {SECTION}.{key} in the DeepSpeed config is {value!r}; it must be a number of GiB, 0 or "
            f"more{also} ({what}), e.g. 1.5. Nothing was allocated."
        )
    return int(value * GIB)


def budget_bytes(config):
    """The host-memory budget ``config`` gives kept sub groups, in bytes; ConfigError for a value that is not
    one."""
    return _gib_value(_ours(config), KEY, 0, "GiB of host memory for optimizer sub groups kept off the NVMe disk")


@dataclasses.dataclass(frozen=True)
class Streaming:
    """The streaming tier's settings: frozen weights beyond ``on_card`` bytes stay in pinned host memory and are
    copied to the card ahead of each use (streaming/). ``on_card`` None: as much as the card leaves free beside
    ``reserve`` bytes for activations."""

    enabled: bool = False
    on_card: int = None
    reserve: int = int(DEFAULT_CARD_RESERVE_GIB * GIB)


def streaming(config):
    """The config's streaming settings; ConfigError for a value that is not one, or for streaming under ZeRO-3
    (whose parameter offload already moves every weight itself)."""
    ours = _ours(config)
    enabled = ours.get(STREAM, False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"accel_ds_fix: {SECTION}.{STREAM} in the DeepSpeed config is {enabled!r}; it is true or "
                          f"false. Nothing was allocated.")
    if enabled and zero_stage(config) == 3:
        raise ConfigError(
            f"accel_ds_fix: {SECTION}.{STREAM} is set in a ZeRO-3 config. ZeRO-3 partitions and moves every weight "
            f"itself; streaming frozen weights goes with ZeRO stage 0, 1 or 2 (configs/accelerate_zero2_stream.yaml). "
            f"Nothing was allocated.")
    on_card = _gib_value(ours, ON_CARD, "auto", "GiB of frozen weights kept on the card, the rest streamed; "
                         "left out: as much as the card leaves", auto=True)
    reserve = _gib_value(ours, RESERVE, DEFAULT_CARD_RESERVE_GIB, "GiB of the card kept free for activations")
    return Streaming(enabled, on_card, reserve)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the DeepSpeed config contributes to a training (``from_config`` reads it)."""

    stage: int = 2
    half_bytes: int = 2
    master_bytes: int = 4
    optimizer_state_bytes: int = 8  # Adam: exp_avg + exp_avg_sq in fp32
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"
    pin_memory: bool = False
    reduce_bucket: int = int(5e8)
    prefetch_bucket: int = int(5e7)
    max_live: int = int(1e9)
    sub_group: int = int(1e9)
    swap_buffers: int = 4
    pipelined: bool = False  # NVMe offload with pipeline_read or pipeline_write
    nvme_ram: int = 0  # bytes of host memory for sub groups kept off the disk (nvme/sub_groups_in_ram.py)
    grad_accum_bytes: int = 4
    world_size: int = 1
    stream: bool = False  # frozen weights beyond frozen_on_card stream from pinned host memory (streaming/)
    frozen_on_card: int = None  # bytes of frozen weights kept on the card; None: as much as the card leaves
    card_reserve: int = 0  # bytes the streaming tier keeps free of frozen weights for activations and temporaries

    @classmethod
    def from_config(cls, config, mixed_precision="no", world_size=1, hidden_size=None):
        def enabled(name):
            value = section(config, name).get("enabled", False)
            return mixed_precision == name if value == "auto" else bool(value)

        def number(value, default):
            if value == "auto":  # accelerate fills these from the model's hidden size
                return default if hidden_size is None else None
            return int(float(value)) if value is not None else default

        zero = section(config, "zero_optimization")
        half = 2 if (enabled("fp16") or enabled("bf16")) else 4
        low_master = (section(config, "fp16").get("fp16_master_weights_and_grads")
                      or section(config, "bf16").get("bf16_master_weights_and_grads"))
        opt, par = section(zero, "offload_optimizer"), section(zero, "offload_param")
        hidden = hidden_size or 1
        reduce_bucket = number(zero.get("reduce_bucket_size"), int(5e8))
        prefetch = number(zero.get("stage3_prefetch_bucket_size"), int(5e7))
        accum = section(config, "data_types").get("grad_accum_dtype")
        return cls(
            stage=zero_stage(config),
            half_bytes=half,
            master_bytes=2 if (low_master and half == 2) else 4,
            offload_optimizer=offload_device(config, "offload_optimizer"),
            offload_param=offload_device(config, "offload_param"),
            pin_memory=bool(opt.get("pin_memory", False) or par.get("pin_memory", False)),
            reduce_bucket=reduce_bucket if reduce_bucket is not None else hidden * hidden,
            prefetch_bucket=prefetch if prefetch is not None else int(0.9 * hidden * hidden),
            max_live=number(zero.get("stage3_max_live_parameters"), int(1e9)) or int(1e9),
            sub_group=number(zero.get("sub_group_size"), int(1e9)),
            swap_buffers=int(opt.get("buffer_count", 4)),
            pipelined=bool(opt.get("pipeline_read") or opt.get("pipeline_write")),
            nvme_ram=budget_bytes(config) if offload_device(config, "offload_optimizer") == "nvme" else 0,
            grad_accum_bytes=2 if accum in ("fp16", "bf16") else (2 if (low_master and half == 2) else 4),
            world_size=world_size,
            stream=streaming(config).enabled,
            frozen_on_card=streaming(config).on_card,
            card_reserve=streaming(config).reserve,
        )
