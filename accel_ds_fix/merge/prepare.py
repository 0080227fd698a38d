"""Accelerator.prepare: the models of one call become one module for one DeepSpeed engine, and each model
comes back as a proxy. With one model, or without DeepSpeed, accelerate runs untouched (on accelerate 0.15 - 0.17
the DeepSpeed config and optimizer are first brought to what later releases make of them: patches/old_accelerate.py)."""

import logging

import torch

from .. import gather, notices
from ..lookup import deepspeed_config, uses_deepspeed
from ..memory import check as memory_check
from ..checkpoints import deferred_save
from ..patches import (clipping, cpu_threads, gpu_block_release, old_accelerate, zero3_direct_calls, zero3_dtypes,
                       zero3_forward_alone, zero3_held_moves, zero3_host_partition, zero3_unprepared)
from . import engine_per_optimizer, engine_setup, gradient_explanation, textual_inversion, trainability
from .merge_plan import MergePlan, is_optimizer
from .merged_module import MergedModels


def _say_if_half_precision_weights(plan):
    # kohya's --full_fp16 casts the trained models to fp16 before prepare() and then patches
    # accelerator.scaler, which is None under DeepSpeed. DeepSpeed's own fp16/bf16 mode already keeps fp32
    # master weights, so the cast buys nothing here. Weights zero.Init made (ds_id: transformers under a ZeRO-3
    # config) are in half precision by DeepSpeed's own doing.
    half = [plan.label(i) for i, m in enumerate(plan.models)
            if any(p.requires_grad and p.dtype in (torch.float16, torch.bfloat16) and not hasattr(p, "ds_id")
                   for p in m.parameters())]
    if half:
        notices.say(
            f"trainable weights of {', '.join(half)} are already in half precision. DeepSpeed keeps fp32 master "
            "weights of them and trains those, so nothing is lost (diffusers' LoRA scripts leave a LoRA in bf16 under "
            "bf16: nothing to do). kohya's --full_fp16 (and --full_bf16) cast the models and patch "
            "accelerator.scaler, which is None under DeepSpeed (AttributeError): drop those flags and train fp32 "
            "weights with mixed_precision fp16/bf16.",
            level=logging.WARNING,
        )


def prepare(wrapped, instance, args, kwargs):
    """Accelerator.prepare: merge 2+ models into one module before DeepSpeed sees them."""
    if not uses_deepspeed(instance):
        return wrapped(*args, **kwargs)
    config = deepspeed_config(instance)
    clipping.record_configured(instance, config)
    zero = config.get("zero_optimization", {})
    offload_device = zero.get("offload_optimizer", {}).get("device", "none")
    force_cpu_optimizer = config.get("zero_force_ds_cpu_optimizer", True)
    old_accelerate.fill_precision(config, getattr(instance, "mixed_precision", None))
    if offload_device not in (None, "none") and force_cpu_optimizer:
        args = old_accelerate.with_cpu_adam(args)
    models = [obj for obj in args if isinstance(obj, torch.nn.Module)]
    if models and zero.get("stage") == 3:  # an engine is built here, on every process together
        textual_inversion.refuse(models, [type(m).__name__ for m in models], zero)
        zero3_held_moves.at_prepare(models)
        zero3_unprepared.at_prepare(models)
    if models:  # one model too: without the op DeepSpeed would stop halfway through building the engine
        optimizer = next((obj for obj in args if isinstance(obj, torch.optim.Optimizer)), None)
        memory_check.check_prerequisites(models, optimizer, config, instance)
    if models and sum(1 for obj in args if is_optimizer(obj)) > 1:  # GAN-style: one engine per optimizer
        return engine_per_optimizer.prepare(wrapped, instance, args, kwargs, config)
    if len(models) < 2:
        if not (models and zero.get("stage") == 3):
            return wrapped(*args, **kwargs)
        dtype = zero3_dtypes.training_dtype(config, getattr(instance, "mixed_precision", None))
        zero3_host_partition.partition_from_host(models[0], config, dtype, instance.device)
        result = wrapped(*args, **kwargs)
        engine = result[args.index(models[0])] if isinstance(result, (tuple, list)) else result
        # kohya's --deepspeed wraps its models in one module: it calls them, and saves them, one by one
        zero3_direct_calls.watch(engine)
        gather.add_full_weight_hooks(list(engine.module.modules())[1:])  # the root's state_dict is DeepSpeed's
        return result

    plan = MergePlan(args)
    plan.check(offload_device=offload_device, force_cpu_optimizer=force_cpu_optimizer)
    memory_check.check_before_allocating(plan, config, instance)
    _say_if_half_precision_weights(plan)
    if offload_device not in (None, "none"):
        cpu_threads.warn_if_few_for_cpu_optimizer()
    description = plan.describe(zero.get("stage"))
    if zero.get("stage") == 3:
        dtype = zero3_dtypes.training_dtype(config, getattr(instance, "mixed_precision", None))
        zero3_dtypes.cast_beside_zero3_initialized(plan.models, dtype)
    merged = MergedModels(plan.models, plan.names)
    held = trainability.held_by(plan.optimizers[0] if plan.optimizers else None)
    if zero.get("stage") == 3:
        zero3_host_partition.partition_from_host(merged, config, dtype, instance.device)

    # The merged module takes the first model's place; the other models leave the call.
    first = plan.positions[0]
    inner_args = [merged if i == first else obj for i, obj in enumerate(args) if i == first or i not in plan.positions]
    with gpu_block_release.building_engine():
        result = wrapped(*inner_args, **kwargs)
    result = list(result) if isinstance(result, (tuple, list)) else [result]
    engine = result[first]

    proxies = engine_setup.adopt(engine, plan.names, plan.models)
    deferred_save.arm(instance)  # several processes: a save_state on the main process alone is saved by all
    if zero.get("stage") == 3:
        zero3_forward_alone.watch(plan.models)
    engine._accel_ds_fix_in_optimizer = held
    handed_back = []
    remaining = iter(result)
    for i, obj in enumerate(args):
        if i in plan.positions:
            if i == first:
                next(remaining)
            handed_back.append(proxies[plan.names[plan.positions.index(i)]])
        else:
            handed_back.append(next(remaining))
    gradient_explanation.watch(zero.get("stage"))
    if instance.is_main_process:
        notices.say(description)
        clipping.say_at_prepare(instance)
    return tuple(handed_back)
