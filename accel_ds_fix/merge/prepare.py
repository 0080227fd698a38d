"""Accelerator.prepare: the models of one call become one module for one DeepSpeed engine, and each model
comes back as a proxy. With one model, or without DeepSpeed, accelerate runs untouched (on accelerate 0.15 - 0.17
the DeepSpeed config and optimizer are first brought to what later releases make of them: launch/old_accelerate.py)."""

import contextlib
import logging

import torch

from .. import notices
from ..deepspeed_config import section, streaming
from ..launch import cpu_threads, old_accelerate
from ..lookup import deepspeed_config, engine_record, uses_deepspeed
from ..memory import check as memory_check
from ..processes import deferred_save
from ..streaming import engine_build as streaming_build
from ..weights import full_weights
from ..zero3 import direct_calls, dtypes, forward_alone, held_moves, host_partition, unprepared
from . import (clipping, engine_per_optimizer, engine_setup, gpu_block_release, gradient_explanation, script_clipping,
               textual_inversion, trainability)
from .merge_plan import MergePlan
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


def _streaming(plan, others, config, precision, instance, streams=True):
    """The streaming tier's engine build (streaming/engine_build.py); nothing for another config."""
    if not streams:
        return contextlib.nullcontext()
    dtype = dtypes.training_dtype(config, precision)
    trained = [p for m in plan.models for p in m.parameters() if p.requires_grad]
    # the trained weights in the training precision, ZeRO-2's gradient bucket and its flat copy while it builds
    engine_bytes = 3 * sum(p.numel() for p in trained) * (2 if dtype is not None else 4)
    return streaming_build.while_engine_is_built(plan.models, plan.names, others, config, dtype, instance.device,
                                                 engine_bytes)


def prepare(wrapped, instance, args, kwargs):
    """Accelerator.prepare: merge 2+ models into one module before DeepSpeed sees them."""
    if not uses_deepspeed(instance):
        return wrapped(*args, **kwargs)
    config = deepspeed_config(instance)
    clipping.record_configured(instance, config)
    precision = getattr(instance, "mixed_precision", None)
    old_accelerate.fill_precision(config, precision)
    args = old_accelerate.with_cpu_adam(args, config)
    plan = MergePlan(args, config, precision)
    models, stage = plan.models, plan.stage
    streams = bool(models) and streaming(config).enabled  # ConfigError here for a section it cannot read
    others = held_moves.hand_over(models) if streams else []
    if models and stage == 3:  # an engine is built here, on every process together
        textual_inversion.refuse(models, [type(m).__name__ for m in models], section(config, "zero_optimization"))
        held_moves.at_prepare(models)
        unprepared.at_prepare(models)
    if models:  # one model too: without the op DeepSpeed would stop halfway through building the engine
        optimizer = next((obj for obj in args if isinstance(obj, torch.optim.Optimizer)), None)
        memory_check.check_prerequisites(models, optimizer, config, instance)
    if models and len(plan.optimizers) > 1:  # GAN-style: one engine per optimizer
        return engine_per_optimizer.prepare(wrapped, instance, args, kwargs, plan)
    if len(models) < 2:
        if streams:
            with _streaming(plan, others, config, precision, instance):
                result = wrapped(*args, **kwargs)
            streaming_build.name_in_engine(result[args.index(models[0])] if isinstance(result, (tuple, list)) else result)
            return result
        if not (models and stage == 3):
            return wrapped(*args, **kwargs)
        dtype = dtypes.training_dtype(config, precision)
        with host_partition.when_the_engine_is_built(models[0], config, dtype, instance.device):
            result = wrapped(*args, **kwargs)
        engine = result[args.index(models[0])] if isinstance(result, (tuple, list)) else result
        # kohya's --deepspeed wraps its models in one module: it calls them, and saves them, one by one
        direct_calls.watch(engine)
        full_weights.add_full_weight_hooks(list(engine.module.modules())[1:])  # the root's state_dict is DeepSpeed's
        return result

    plan.check()
    memory_check.check_before_allocating(plan, config, instance)
    _say_if_half_precision_weights(plan)
    if plan.optimizer_offload != "none":
        cpu_threads.warn_if_few_for_cpu_optimizer()
    description = plan.describe(stage)
    if stage == 3:
        dtype = dtypes.training_dtype(config, precision)
        dtypes.cast_beside_zero3_initialized(plan.models, dtype)
    merged = MergedModels(plan.models, plan.names)
    held = trainability.held_by(plan.optimizers[0] if plan.optimizers else None)
    if stage == 3:
        host_partition.partition_from_host(merged, config, dtype, instance.device)

    # The merged module takes the first model's place; the other models leave the call.
    first = plan.positions[0]
    inner_args = [merged if i == first else obj for i, obj in enumerate(args) if i == first or i not in plan.positions]
    with gpu_block_release.building_engine(), _streaming(plan, others, config, precision, instance, streams):
        result = wrapped(*inner_args, **kwargs)
    result = list(result) if isinstance(result, (tuple, list)) else [result]
    engine = result[first]
    if streams:
        streaming_build.name_in_engine(engine)

    proxies = engine_setup.adopt(engine, plan.names, plan.models)
    deferred_save.arm(instance)  # several processes: a save_state on the main process alone is saved by all
    if stage == 3:
        forward_alone.watch(plan.models)
    engine_record(engine).in_optimizer = held
    handed_back = []
    remaining = iter(result)
    for i, obj in enumerate(args):
        if i in plan.positions:
            if i == first:
                next(remaining)
            handed_back.append(proxies[plan.names[plan.positions.index(i)]])
        else:
            handed_back.append(next(remaining))
    # the script's clip_grad_norm_ as plain accelerate applies it: the engine's step waits for it
    script_clipping.arm(engine, handed_back[plan.optimizer_positions[0]] if plan.optimizers else None)
    gradient_explanation.watch(stage)
    if instance.is_main_process:
        notices.say(description)
        clipping.say_at_prepare(instance)
    return tuple(handed_back)
