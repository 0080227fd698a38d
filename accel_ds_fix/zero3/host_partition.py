"""ZeRO-3: the models of prepare() are partitioned from host memory, one weight at a time, instead of passing
through the card whole.

DeepSpeed (0.19.8, engine.py _configure_distributed_model) moves a module that zero.Init did not build to the
device in one piece, and only then partitions it (parameter_offload.py: zero.Init(module=...)). The card must
hold every weight in half precision at once: 24 GB for Flux.1's transformer, which is what ZeRO-3 with its
weights on the CPU is meant to avoid. Converting the module with zero.Init(module=...) before the engine is built
runs DeepSpeed's own conversion, one parameter on the card at a time (then its shard goes where offload_param
says); the engine then takes the module as one zero.Init built and leaves it where it is. What DeepSpeed would
have done besides is done here: the weights are cast to the training precision first (its cast skips zero.Init
models) and the buffers, never partitioned, are moved to the card.
"""

import contextlib
import copy

import torch

from ..deepspeed_config import offload_device, section
from .dtypes import CASTABLE


def _settled(config, dtype):
    """The config as zero.Init reads it, before accelerate has filled its "auto" values (it does so while building
    the engine): the ZeRO section without them, the batch sizes at one, the precision ``dtype``."""
    zero = {k: v for k, v in section(config, "zero_optimization").items() if v != "auto"}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "fp16": {"enabled": dtype == torch.float16}, "bf16": {"enabled": dtype == torch.bfloat16}}


def partition_from_host(module, config, dtype, device):
    """Partition ``module``'s weights that zero.Init has not made, one at a time; return how many were."""
    import deepspeed

    todo = [p for p in module.parameters() if not hasattr(p, "ds_id")]
    if not todo:
        return 0
    for p in todo:
        if dtype is not None and p.dtype in CASTABLE and p.dtype != dtype:
            p.data = p.data.to(dtype)
    offload = offload_device(config, "offload_param")
    deepspeed.zero.Init(module=module, config_dict_or_path=_settled(config, dtype), dtype=dtype,
                        remote_device=offload if offload in ("cpu", "nvme") else None)
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.device != torch.device(device):
                sub._buffers[name] = buffer.to(device)
    return len(todo)


@contextlib.contextmanager
def when_the_engine_is_built(module, config, dtype, device):
    """Around accelerate's prepare() of one model: partition ``module`` from host memory at accelerate's call of
    deepspeed.initialize, after accelerate's own checks (a missing ``model.config`` for "auto" bucket sizes, say),
    so that a user meets accelerate's errors first, as without the fix. ``config`` is read as it is now, before
    accelerate fills its "auto" values, as partition_from_host reads it."""
    import deepspeed

    config, original = copy.deepcopy(config), deepspeed.initialize

    def initialize(*args, **kwargs):
        partition_from_host(module, config, dtype, device)
        return original(*args, **kwargs)

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original
