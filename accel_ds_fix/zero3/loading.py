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

Building under zero.Init is a collective: with several processes, every process must load the model together.
kohya's scripts load on one process at a time (to spare host memory: process 0 loads while the others wait at a
barrier), which waited for ever, with DeepSpeed alone too. A process whose load the others do not join within
LOAD_TOGETHER_S builds it whole, as do the others when their turn comes (every_process.missing decides alike for
all); prepare() partitions it from host memory then.
"""

import contextlib
import logging
import sys

from .. import notices
from ..processes import every_process

# Processes that load together reach the same from_pretrained within moments of each other.
LOAD_TOGETHER_S = 10


def _zero3_enabled():
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:  # transformers < 4.33
        from transformers.deepspeed import is_deepspeed_zero3_enabled
    return is_deepspeed_zero3_enabled()


def drop_low_cpu_mem_usage(wrapped, instance, args, kwargs):
    """PreTrainedModel.from_pretrained under ZeRO-3: without low_cpu_mem_usage=True (no device_map); built whole
    where the processes load it one at a time."""
    if not _zero3_enabled():
        return wrapped(*args, **kwargs)
    if kwargs.get("low_cpu_mem_usage") and kwargs.get("device_map") is None:
        kwargs = {k: v for k, v in kwargs.items() if k != "low_cpu_mem_usage"}
        notices.say("ZeRO-3: transformers builds the model under zero.Init, a shard at a time; low_cpu_mem_usage="
                    "True, which this transformers release refuses there, is dropped (as transformers >= 4.51 does)",
                    level=logging.INFO, once_key="low_cpu_mem_usage")
    if every_process.several_processes() and every_process.missing("from_pretrained", LOAD_TOGETHER_S):
        notices.say("ZeRO-3: the processes load the model one at a time (kohya's scripts do), and building it under "
                    "zero.Init would need all of them together: each builds it whole instead, and prepare() "
                    "partitions it from host memory", level=logging.INFO, once_key="loaded_in_turn")
        with models_built_whole():
            return wrapped(*args, **kwargs)
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
