"""accelerate 0.15 - 0.17 and the shipped tiers: what later releases do and these leave undone.

kohya's January 2023 scripts (bf691aef) pin accelerate 0.15. With the shipped DeepSpeed configs it stops three times before
training: it refuses `"gradient_accumulation_steps": "auto"` in a config file ("cannot be set to 'auto'"), cannot
fill `"fp16"`/`"bf16"` `"enabled": "auto"` ("`fp16.enabled` not found in kwargs") - 0.16 fills both - and under
optimizer offload hands the script's torch AdamW to DeepSpeed, which refuses a client optimizer there ("ZeRO-Offload
with a client provided optimizer"); 0.18 runs it as DeepSpeedCPUAdam. On these releases the fix does the same: the
accumulation steps become 1 when the plugin reads the file (0.15 puts the Accelerator's own value there before it
builds the engine), the precision switches follow the Accelerator's mixed_precision at prepare(), and torch
Adam/AdamW becomes DeepSpeedCPUAdam with its parameter groups, lr and weight decay, exactly as 0.18 does.
"""

import json
import os

import torch

from .. import versions
from ..deepspeed_config import cpu_optimizer_forced

FILLS_AUTO_VALUES = "0.16.0"
SWAPS_IN_CPU_ADAM = "0.18.0"


def fill_accumulation_steps(plugin):
    """DeepSpeedPlugin.__post_init__: hand accelerate 0.15 the config with "auto" accumulation steps made 1."""
    if not versions.older_than("accelerate", FILLS_AUTO_VALUES):
        return
    source = plugin.hf_ds_config
    if source is None:
        source = os.environ.get("DEEPSPEED_CONFIG_FILE", "none")  # accelerate 0.15's name for it
    if isinstance(source, str) and os.path.isfile(source):
        with open(source) as f:
            source = json.load(f)
    if isinstance(source, dict) and source.get("gradient_accumulation_steps") == "auto":
        plugin.hf_ds_config = {**source, "gradient_accumulation_steps": 1}


def fill_precision(config, mixed_precision):
    """prepare(): "enabled": "auto" of fp16/bf16 becomes whether the Accelerator trains in that precision."""
    if not versions.older_than("accelerate", FILLS_AUTO_VALUES):
        return
    for precision in ("fp16", "bf16"):
        section = config.get(precision)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            section["enabled"] = mixed_precision == precision


def with_cpu_adam(args, config):
    """prepare()'s arguments, where ``config`` has accelerate swap in DeepSpeed's CPU optimizer (offload), with a
    torch Adam/AdamW swapped for DeepSpeedCPUAdam as later releases do."""
    if not versions.older_than("accelerate", SWAPS_IN_CPU_ADAM) or not cpu_optimizer_forced(config):
        return args
    return tuple(cpu_adam_like(obj) if isinstance(obj, (torch.optim.Adam, torch.optim.AdamW)) else obj
                 for obj in args)


def cpu_adam_like(optimizer):
    """DeepSpeedCPUAdam over ``optimizer``'s parameter groups, as accelerate >= 0.18 builds it."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    defaults = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "weight_decay")}
    return DeepSpeedCPUAdam(optimizer.param_groups, **defaults)
