"""Gradient clipping under DeepSpeed, said as it really is. The engine clips every step to the config's
gradient_clipping, and accelerate.clip_grad_norm_ only reports the norm. accelerate fills a config's "auto" (and
the gradient_clipping its own DeepSpeed settings leave unset) with 1.0, so a script that never clips under plain
accelerate is clipped at 1.0 here: said once at prepare(). A script's max_norm that is not what the engine uses is
said once where it is asked for. With one engine per optimizer (GAN-style scripts) the norm reported is that of the
engine owning the parameters given (accelerate would report the first engine's)."""

import logging

from .. import notices
from ..lookup import NOT_RECORDED, accelerator_record, deepspeed_config, merged_engine, merged_engines
from . import script_clipping


def record_configured(accelerator, config):
    """At the first prepare(), before accelerate fills in "auto": what the DeepSpeed config itself says of
    gradient_clipping."""
    record = accelerator_record(accelerator)
    if record.clipping_as_configured is NOT_RECORDED:
        record.clipping_as_configured = config.get("gradient_clipping", "auto")


def _configured(accelerator, otherwise):
    record = accelerator_record(accelerator, create=False)
    configured = record.clipping_as_configured if record is not None else NOT_RECORDED
    return otherwise if configured is NOT_RECORDED else configured


def _in_effect(accelerator):
    """(the norm the engine clips to, 0 for none; where that value comes from, in words)."""
    engine = merged_engine(accelerator)
    value = float(engine.gradient_clipping() or 0) if engine is not None else 0.0
    configured = _configured(accelerator, deepspeed_config(accelerator).get("gradient_clipping"))
    if configured == "auto":
        return value, f'the DeepSpeed config\'s gradient_clipping is "auto", which accelerate fills with {value:g}'
    if configured is None:
        return value, f"the DeepSpeed config sets no gradient_clipping; accelerate filled in {value:g}"
    return value, "the DeepSpeed config's gradient_clipping"


def say_at_prepare(accelerator):
    """Once, when a merged engine clips without the config asking for it."""
    value, source = _in_effect(accelerator)
    if value and _configured(accelerator, None) in (None, "auto"):
        notices.say(
            f"the DeepSpeed engine clips the gradients' norm to {value:g} at every step ({source}). Without "
            "DeepSpeed a script clips only where it calls accelerator.clip_grad_norm_(). Set gradient_clipping in "
            "the DeepSpeed config to choose (0: no clipping).",
            once_key=("clipping", id(accelerator)),
        )


def _as_the_script_asks(engine, wrapped, instance, args, kwargs):
    """One merged engine: its held step runs clipped to the script's max_norm over the parameters it names
    (script_clipping.py); the norm returned is that step's, as accelerate returns it."""
    parameters = args[0] if args else kwargs.get("parameters")
    max_norm = args[1] if len(args) > 1 else kwargs.get("max_norm")
    norm_type = args[2] if len(args) > 2 else kwargs.get("norm_type", 2)
    parameters = [parameters] if hasattr(parameters, "grad") else list(parameters)
    l2 = float(norm_type) == 2.0
    script_clipping.run_held_step(engine, parameters, float(max_norm) if l2 and max_norm is not None else None)
    if not accelerator_record(instance).clip_said:
        accelerator_record(instance).clip_said = True
        value, source = _in_effect(instance)
        left_out = script_clipping.clips_part_of_the_engine(engine, parameters)
        otherwise = f"clip to {value:g}: {source}" if value else f"are not clipped: {source}"
        if not l2:
            notices.say(f"accelerator.clip_grad_norm_(norm_type={norm_type}): DeepSpeed clips by the L2 norm only, so "
                        f"this call is not applied here; the engine's steps {otherwise}. Use norm_type=2 to clip as "
                        "the script asks.", level=logging.WARNING)
            return wrapped(parameters, *args[1:], **{k: v for k, v in kwargs.items() if k != "parameters"})
        notices.say(f"accelerator.clip_grad_norm_() is applied as without DeepSpeed: the engine's step clips to "
                    f"max_norm={max_norm:g} over the parameters the script names, those outside DeepSpeed's "
                    f"optimizer counted too (steps without the call {otherwise})")
        if left_out:
            notices.say(f"accelerator.clip_grad_norm_() names {left_out} fewer parameter(s) than DeepSpeed trains in "
                        "the merged engine: DeepSpeed scales the gradients of all it trains by one factor, so those "
                        "are clipped too, where without DeepSpeed they would not be. Pass every trained model's "
                        "parameters to clip_grad_norm_ to clip as without DeepSpeed.", level=logging.WARNING)
    rest = {k: v for k, v in kwargs.items() if k != "parameters"}
    return wrapped(parameters, *args[1:], **rest)


def clip_grad_norm_(wrapped, instance, args, kwargs):
    engines = merged_engines(instance)
    if len(engines) == 1 and script_clipping.holds_steps(engines[0]):
        return _as_the_script_asks(engines[0], wrapped, instance, args, kwargs)
    if merged_engine(instance) is not None and not accelerator_record(instance).clip_said:
        accelerator_record(instance).clip_said = True
        max_norm = args[1] if len(args) > 1 else kwargs.get("max_norm")
        value, source = _in_effect(instance)
        if max_norm is not None and value and float(max_norm) == value:
            notices.say(f"accelerator.clip_grad_norm_() only reports the norm under DeepSpeed: the engine clips "
                        f"every step to {value:g} ({source}), the max_norm the script gives.")
        else:
            clips = f"clips every step to a norm of {value:g}" if value else "does not clip (gradient_clipping 0)"
            notices.say(
                f"accelerator.clip_grad_norm_() only reports the norm under DeepSpeed: the engine {clips} ({source}), "
                f"so max_norm={max_norm} is not applied here. Set gradient_clipping in the DeepSpeed config to "
                f"{max_norm} to clip as the script asks.",
                level=logging.WARNING,
            )
    if len(engines) > 1:
        given = args[0] if args else kwargs.get("parameters")
        given = {id(p) for p in ([given] if hasattr(given, "grad") else given)}
        engine = next((e for e in engines if any(id(p) in given for p in e.module.parameters())), engines[0])
        norm = engine.get_global_grad_norm()
        return norm.item() if hasattr(norm, "item") else norm
    return wrapped(*args, **kwargs)
