"""ZeRO-3: a transformers model that a script loads but never prepares (Flux's frozen T5) is made whole to be used.

Under a ZeRO-3 config accelerate registers a HfDeepSpeedConfig with transformers (whatever zero3_init_flag says), so
every from_pretrained runs under deepspeed.zero.Init and returns shape-[0] shards. Only a DeepSpeed engine gathers
them for forward: diffusers' Flux scripts encode prompts with a T5 they freeze and never prepare, and stopped at its
first layer ("'weight' must be 2-D" in the embedding), with or without this package. A model outside every engine is
not DeepSpeed's to partition: it is gathered whole, once, as ZeRO-2 or no DeepSpeed would hold it, in the dtype and
on the device that the script's .to() asked for (a shard keeps the dtype it was loaded in; its empty placeholder
follows .to()). The same Parameter objects are kept, so an optimizer or a later prepare() still holds them.

When: at a prepare() that builds an engine, for every such model not among its arguments (every process is there, and
gathering is a collective); before that, at the model's first forward (prompts encoded before prepare(): with several
processes each must run that forward, as each runs prepare()). A model passed to prepare() is left to its engine. A
model loaded after that prepare() (the scripts reload the pipeline at the end to save it) is built whole, in host
memory as from_pretrained gives it without DeepSpeed (its save_pretrained wrote shape-[0]
tensors, and with several processes its partitioned build on the main process alone waited for the others).
The cost: each process holds the whole model, as without ZeRO-3 (T5-XXL: 9.5 GB in bf16).
"""

import logging
import weakref

from .. import notices
from ..weights.partitioned import is_partitioned, shards
from . import first_forward, loading

# What DeepSpeed's Init._convert_to_deepspeed_param puts on a parameter besides its ds_* attributes.
_DEEPSPEED_PARAM_ATTRIBUTES = (
    "all_gather", "all_gather_coalesced", "partition", "reduce_gradients_at_owner", "partition_gradients",
    "aligned_size", "padding_size", "partition_numel", "item", "convert_to_zero_parameters", "is_external_param",
    "nvme_swapper",
)
_watched = weakref.WeakKeyDictionary()  # model -> hook handles of its first-forward check
_engine_built = False  # a ZeRO-3 prepare() has run: no later one is expected to take a model loaded now


def watch_loaded(wrapped, instance, args, kwargs):
    """PreTrainedModel.from_pretrained: a model that comes back partitioned is made whole at its first forward,
    unless prepare() takes it first."""
    if _engine_built:
        # no later prepare() is expected to take it: built whole, as without DeepSpeed, and without zero.Init's
        # collectives (the scripts reload the pipeline on the main process alone: with several processes a
        # partitioned build waited there for the others, which had finished)
        with loading.models_built_whole():
            return wrapped(*args, **kwargs)
    model = wrapped(*args, **kwargs)
    if _has_partitioned_params(model):
        _watched[model] = first_forward.watch(model, make_whole)
    return model


def at_prepare(models):
    """prepare() under ZeRO-3, with ``models`` among its arguments: those (and models inside them) go to an engine;
    every other loaded model still partitioned is made whole now, while every process is here."""
    global _engine_built
    _engine_built = True
    prepared = first_forward.module_ids(models)
    for model in list(_watched.keys()):
        if id(model) in prepared:
            _stop_watching(model)
        else:
            make_whole(model)


def make_whole(model):
    """Replace each ZeRO-3 shard of ``model`` with its full value (a collective) where the script's last .to()
    asked; the parameters stay the same objects. Returns how many were gathered."""
    _stop_watching(model)
    params = [p for p in model.parameters() if is_partitioned(p)]
    if not params:
        return 0
    import deepspeed

    for param in params:  # one at a time: no second copy of the whole model
        placeholder = param.data  # empty, but in the dtype and on the device of the script's last .to()
        with deepspeed.zero.GatheredParameters(shards([param]), modifier_rank=None):
            full = param.data.to(placeholder.device, placeholder.dtype, copy=True)
        param.data = full
        _forget_partitioning(param)
    numel = sum(p.numel() for p in params)
    notices.say(f"ZeRO-3: {type(model).__name__} was loaded partitioned (transformers builds every model under "
                f"accelerate's ZeRO-3 config) and is used without prepare(): its {numel:,} weights are gathered "
                "whole on each process, as ZeRO-2 would hold them. To keep it partitioned, pass it to prepare().",
                level=logging.INFO, once_key=("zero3_unprepared", type(model).__name__))
    return len(params)


def _stop_watching(model):
    first_forward.unwatch(_watched.pop(model, ()))


def _has_partitioned_params(model):
    return hasattr(model, "parameters") and any(is_partitioned(p) for p in model.parameters())


def _forget_partitioning(param):
    # Without ds_id DeepSpeed sees an ordinary parameter: a later engine partitions it afresh.
    for name in [n for n in vars(param) if n.startswith("ds_")] + list(_DEEPSPEED_PARAM_ATTRIBUTES):
        param.__dict__.pop(name, None)
