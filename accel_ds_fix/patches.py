"""Wrappers for accelerate.Accelerator methods. Each one leaves accelerate untouched unless the call involves
models merged by this package."""

import logging

import torch

from .merged import MergedModels
from .plan import MergePlan
from .proxy import ModelProxy

logger = logging.getLogger("accel_ds_fix")


def uses_deepspeed(accelerator):
    return getattr(accelerator.distributed_type, "value", accelerator.distributed_type) == "DEEPSPEED"


def _count(params):
    n = sum(p.numel() for p in params)
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _describe(plan, accelerator):
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    stage = plugin.deepspeed_config.get("zero_optimization", {}).get("stage") if plugin else None
    parts = []
    for name, model in zip(plan.names, plan.models):
        params = list(model.parameters())
        trainable = _count(p for p in params if p.requires_grad)
        parts.append(f"{name} ({type(model).__name__}, {_count(params)} params, {trainable} trainable)")
    return f"merged {len(plan.models)} models into one DeepSpeed engine (ZeRO stage {stage}): " + ", ".join(parts)


def prepare(wrapped, instance, args, kwargs):
    """Accelerator.prepare: merge 2+ models into one module before DeepSpeed sees them."""
    models = [obj for obj in args if isinstance(obj, torch.nn.Module)]
    if len(models) < 2 or not uses_deepspeed(instance):
        return wrapped(*args, **kwargs)

    plan = MergePlan(args)
    plan.check()
    description = _describe(plan, instance)  # counted before ZeRO-3 partitions the parameters
    merged = MergedModels(plan.models, plan.names)

    # The merged module takes the first model's place; the other models leave the call.
    first = plan.positions[0]
    inner_args = [merged if i == first else obj for i, obj in enumerate(args) if i == first or i not in plan.positions]
    result = wrapped(*inner_args, **kwargs)
    result = list(result) if isinstance(result, (tuple, list)) else [result]
    engine = result[first]

    proxies = {name: ModelProxy(model, engine, name) for name, model in zip(plan.names, plan.models)}
    remaining = iter(result)
    handed_back = []
    for i, obj in enumerate(args):
        if i in plan.positions:
            if i == first:
                next(remaining)
            handed_back.append(proxies[plan.name_of(obj)])
        else:
            handed_back.append(next(remaining))
    engine._accel_ds_fix_proxies = proxies
    if instance.is_main_process:
        logger.info(description)
    return tuple(handed_back)
