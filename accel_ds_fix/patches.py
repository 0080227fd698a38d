"""Wrappers for accelerate.Accelerator methods. Each one leaves accelerate untouched unless the call involves
models merged by this package."""

import functools
import logging
import os

import torch

from . import manifest, zero_memory
from .gather import add_full_weight_hooks, state_dict_for_saving
from .merged import MergedModels
from .plan import MergePlan
from .proxy import ModelProxy, is_proxy

logger = logging.getLogger("accel_ds_fix")


def uses_deepspeed(accelerator):
    return getattr(accelerator.distributed_type, "value", accelerator.distributed_type) == "DEEPSPEED"


def _count(params):
    n = sum(p.numel() for p in params)
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _deepspeed_config(accelerator):
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin.deepspeed_config if plugin else {}


def _describe(plan, stage):
    parts = []
    for name, model in zip(plan.names, plan.models):
        params = list(model.parameters())
        trainable = _count(p for p in params if p.requires_grad)
        parts.append(f"{name} ({type(model).__name__}, {_count(params)} params, {trainable} trainable)")
    return f"merged {len(plan.models)} models into one DeepSpeed engine (ZeRO stage {stage}): " + ", ".join(parts)


def _say_if_half_precision_weights(plan):
    # kohya's --full_fp16 casts the trained models to fp16 before prepare() and then patches
    # accelerator.scaler, which is None under DeepSpeed. DeepSpeed's own fp16/bf16 mode already keeps fp32
    # master weights, so the cast buys nothing here.
    half = [n for n, m in zip(plan.names, plan.models)
            if any(p.requires_grad and p.dtype in (torch.float16, torch.bfloat16) for p in m.parameters())]
    if half:
        logger.warning(
            f"trainable weights of {', '.join(half)} are already in half precision. Under DeepSpeed, train fp32 "
            "weights with mixed_precision fp16/bf16: DeepSpeed keeps fp32 master weights itself. kohya's "
            "--full_fp16 (and --full_bf16) cast the models and patch accelerator.scaler, which is None under "
            "DeepSpeed (AttributeError): drop those flags."
        )


def prepare(wrapped, instance, args, kwargs):
    """Accelerator.prepare: merge 2+ models into one module before DeepSpeed sees them."""
    models = [obj for obj in args if isinstance(obj, torch.nn.Module)]
    if len(models) < 2 or not uses_deepspeed(instance):
        return wrapped(*args, **kwargs)

    plan = MergePlan(args)
    config = _deepspeed_config(instance)
    zero = config.get("zero_optimization", {})
    plan.check(
        offload_device=zero.get("offload_optimizer", {}).get("device", "none"),
        force_cpu_optimizer=config.get("zero_force_ds_cpu_optimizer", True),
    )
    _say_if_half_precision_weights(plan)
    description = _describe(plan, zero.get("stage"))  # counted before ZeRO-3 partitions the parameters
    merged = MergedModels(plan.models, plan.names)

    # The merged module takes the first model's place; the other models leave the call.
    first = plan.positions[0]
    inner_args = [merged if i == first else obj for i, obj in enumerate(args) if i == first or i not in plan.positions]
    with zero_memory.building_engine():
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
    # What construction freed after the hook's last release (ZeRO-2's partition clone, ZeRO-3's gathers) goes back too.
    zero_memory.release_cached_blocks(getattr(engine, "device", None))
    add_full_weight_hooks(plan.models)  # ZeRO-3 only: state_dict() gives full tensors, never shape [0]
    if instance.is_main_process:
        logger.info(description)
    return tuple(handed_back)


def merged_engine(accelerator):
    """The DeepSpeed engine of this accelerator that holds merged models, or None."""
    return next((m for m in accelerator._models if getattr(m, "_accel_ds_fix_proxies", None)), None)


def _first_arg(args, kwargs, name):
    return args[0] if args else kwargs.get(name)


def unwrap_model(wrapped, instance, args, kwargs):
    """Accelerator.unwrap_model: a proxy unwraps to the user's own model."""
    model = _first_arg(args, kwargs, "model")
    return model.__wrapped__ if is_proxy(model) else wrapped(*args, **kwargs)


def get_state_dict(wrapped, instance, args, kwargs):
    """Accelerator.get_state_dict (and save_model, which calls it): that model's own keys, full tensors."""
    model = _first_arg(args, kwargs, "model")
    return state_dict_for_saving(model.__wrapped__) if is_proxy(model) else wrapped(*args, **kwargs)


def _split_merged(models):
    split = []
    for model in models:
        proxies = getattr(model, "_accel_ds_fix_proxies", None)
        split.extend(proxies.values() if proxies else [model])
    return split


def register_save_state_pre_hook(wrapped, instance, args, kwargs):
    """Save hooks see each merged model on its own (diffusers' hooks pick models by class), not the engine."""
    hook = _first_arg(args, kwargs, "hook")

    @functools.wraps(hook)
    def hook_with_models_split(models, weights, output_dir):
        return hook(_split_merged(models), weights, output_dir)

    return wrapped(hook_with_models_split)


def save_state(wrapped, instance, args, kwargs):
    """Accelerator.save_state: DeepSpeed's checkpoint of the merged engine, plus what it holds (manifest)."""
    engine = merged_engine(instance)
    location = wrapped(*args, **kwargs)
    if engine is not None:
        directory = location if isinstance(location, str) else _first_arg(args, kwargs, "output_dir")
        if instance.is_main_process:
            manifest.write(directory, engine.module)
    return location


def load_state(wrapped, instance, args, kwargs):
    """Accelerator.load_state: refuse a checkpoint of other models before DeepSpeed loads any of it."""
    engine = merged_engine(instance)
    if engine is not None:
        directory = _first_arg(args, kwargs, "input_dir")
        automatic = getattr(getattr(instance, "project_configuration", None), "automatic_checkpoint_naming", False)
        if directory is None and automatic:
            directory = manifest.automatic_checkpoint(instance.project_dir)
        if directory is not None and os.path.isdir(os.path.expanduser(directory)):
            manifest.check(os.path.expanduser(directory), engine.module)
    return wrapped(*args, **kwargs)


def clip_grad_norm_(wrapped, instance, args, kwargs):
    """Accelerator.clip_grad_norm_: under DeepSpeed it only reports the norm; say once that the config clips."""
    if merged_engine(instance) is not None and not getattr(instance, "_accel_ds_fix_clip_said", False):
        instance._accel_ds_fix_clip_said = True
        max_norm = args[1] if len(args) > 1 else kwargs.get("max_norm")
        configured = _deepspeed_config(instance).get("gradient_clipping")
        log = logger.info if max_norm == configured else logger.warning
        log(
            "accelerator.clip_grad_norm_() does not clip under DeepSpeed: the engine clips every step to "
            f"gradient_clipping={configured} from the DeepSpeed config, so max_norm={max_norm} is not applied "
            "here. Set gradient_clipping in the DeepSpeed config to change it."
        )
    return wrapped(*args, **kwargs)
