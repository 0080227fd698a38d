"""Accelerator.clip_grad_norm_ with merged models: under DeepSpeed it only reports the norm, and the engine
clips every step to the config's gradient_clipping. Said once, so a script's max_norm is not silently lost. With
one engine per optimizer (GAN-style scripts) the norm reported is that of the engine owning the parameters given
(accelerate would report the first engine's)."""

import logging

from .. import notices
from ..lookup import deepspeed_config, merged_engine, merged_engines


def clip_grad_norm_(wrapped, instance, args, kwargs):
    if merged_engine(instance) is not None and not getattr(instance, "_accel_ds_fix_clip_said", False):
        instance._accel_ds_fix_clip_said = True
        max_norm = args[1] if len(args) > 1 else kwargs.get("max_norm")
        configured = deepspeed_config(instance).get("gradient_clipping")
        notices.say(
            "accelerator.clip_grad_norm_() does not clip under DeepSpeed: the engine clips every step to "
            f"gradient_clipping={configured} from the DeepSpeed config, so max_norm={max_norm} is not applied "
            "here. Set gradient_clipping in the DeepSpeed config to change it.",
            level=logging.INFO if max_norm == configured else logging.WARNING,
        )
    engines = merged_engines(instance)
    if len(engines) > 1:
        given = args[0] if args else kwargs.get("parameters")
        given = {id(p) for p in ([given] if hasattr(given, "grad") else given)}
        engine = next((e for e in engines if any(id(p) in given for p in e.module.parameters())), engines[0])
        norm = engine.get_global_grad_norm()
        return norm.item() if hasattr(norm, "item") else norm
    return wrapped(*args, **kwargs)
