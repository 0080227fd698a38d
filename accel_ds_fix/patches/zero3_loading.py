"""ZeRO-3 and transformers < 4.51: a model loaded with low_cpu_mem_usage=True is loaded, not refused.

accelerate >= 1.0 keeps a HfDeepSpeedConfig alive under every ZeRO-3 config, whatever zero3_init_flag says
(accelerate 0.x did so only with the flag on), so transformers builds each model under zero.Init. transformers
< 4.51 then refuses low_cpu_mem_usage=True ("DeepSpeed Zero-3 is not compatible with `low_cpu_mem_usage=True`"),
and diffusers' pipeline loader passes it for every text encoder: kohya's January 2023 scripts (bf691aef: train_db.py with
diffusers 0.25 and transformers 4.48) stopped while loading the model under the shipped ZeRO-3 tiers. transformers
4.51 and newer drop the argument themselves, since zero.Init already builds the model a shard at a time; this
does the same for the older releases. A device_map is still refused: it is a real conflict with ZeRO-3.

models_built_whole(): where a model must come out whole instead (a save or load hook's own model, a pipeline loaded
after training), transformers is told for that while that no ZeRO-3 config is registered.
"""

import contextlib
import logging
import sys

from .. import notices


def _zero3_enabled():
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:  # transformers < 4.33
        from transformers.deepspeed import is_deepspeed_zero3_enabled
    return is_deepspeed_zero3_enabled()


def drop_low_cpu_mem_usage(wrapped, instance, args, kwargs):
    """PreTrainedModel.from_pretrained: without low_cpu_mem_usage=True under ZeRO-3 (no device_map)."""
    if kwargs.get("low_cpu_mem_usage") and kwargs.get("device_map") is None and _zero3_enabled():
        kwargs = {k: v for k, v in kwargs.items() if k != "low_cpu_mem_usage"}
        notices.say("ZeRO-3: transformers builds the model under zero.Init, a shard at a time; low_cpu_mem_usage="
                    "True, which this transformers release refuses there, is dropped (as transformers >= 4.51 does)",
                    level=logging.INFO, once_key="low_cpu_mem_usage")
    return wrapped(*args, **kwargs)


@contextlib.contextmanager
def models_built_whole():
    """transformers' from_pretrained builds models whole while this runs, as without DeepSpeed: accelerate registers
    its ZeRO-3 config with transformers (a weak reference), and that registration is what sends every load through
    zero.Init, whose shape-[0] shards only an engine gathers and whose construction is a collective (a load on the
    main process alone would wait for the others)."""
    module = sys.modules.get("transformers.integrations.deepspeed") or sys.modules.get("transformers.deepspeed")
    registered = getattr(module, "_hf_deepspeed_config_weak_ref", None)
    if registered is None:
        yield
        return
    module._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        module._hf_deepspeed_config_weak_ref = registered
