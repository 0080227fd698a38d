"""ZeRO-3: a model's move to the card before prepare() is held back, so a model too large for the card can be
partitioned from host memory instead of arriving on the card whole.

diffusers' LoRA scripts (train_dreambooth_lora_flux.py, _sd3, _sdxl) call transformer.to(accelerator.device,
dtype=weight_dtype) on the frozen base before prepare(): 24 GB for Flux.1's transformer, which ZeRO-3 with its
weights offloaded to the CPU would otherwise keep in host memory (a 16 GB card cannot take it whole). Under a
ZeRO-3 config, from the Accelerator's creation until the first prepare() that builds an engine, such a move of a
diffusers or transformers model is held: the dtype is applied at once, the device is remembered, and

- a model passed to prepare() is left where it is: the engine partitions it from host memory
  (zero3/host_partition.py) and puts its shards where offload_param says;
- any other held model (a frozen VAE or text encoder) is moved to the card at that prepare(), or at its first
  forward if a script uses it before: where the script asked, only later.

While a move is held the model's ``device`` reports where the script sent it, so that what the script sends to
the model follows (kohya's `img_tensors.to(vae.device)` before caching latents; a pipeline's execution device for
prior-preservation images): the move itself happens before the model's first forward.

Models that zero.Init already partitioned (transformers' from_pretrained under ZeRO-3) are not held: their
placeholders follow .to() and zero3/unprepared.py makes them whole there. A move after prepare(), to the
CPU, or of a plain torch module passes through unchanged.
"""

import logging
import weakref

import torch

from .. import notices
from ..deepspeed_config import streaming, zero_stage
from ..lookup import deepspeed_config, uses_deepspeed
from ..weights.partitioned import is_partitioned
from . import first_forward

_MODEL_BASES = ("ModelMixin", "PreTrainedModel")  # diffusers' and transformers' model classes
_armed = False
_why = "ZeRO-3"  # or "streaming": the config that holds moves, for the notice
_moving = False  # a held move being carried out: not held again
_held = weakref.WeakKeyDictionary()  # model -> (device, forward pre-hook handles)


def arm_at_init(wrapped, instance, args, kwargs):
    """Accelerator.__init__: hold moves from here under a ZeRO-3 config, or one that streams frozen weights (whose
    prepare() places them: streaming/engine_build.py)."""
    global _armed, _why
    result = wrapped(*args, **kwargs)
    if uses_deepspeed(instance):
        config = deepspeed_config(instance)
        _armed = zero_stage(config) == 3 or streaming(config).enabled
        _why = "ZeRO-3" if zero_stage(config) == 3 else "streaming"
    return result


def hold_back(wrapped, instance, args, kwargs):
    """torch.nn.Module.to: a diffusers/transformers model's move to the card is held while armed."""
    if not _armed or _moving or not _is_model(instance):
        return wrapped(*args, **kwargs)
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if device is None or device.type == "cpu" or any(is_partitioned(p) for p in instance.parameters()):
        if device is not None:
            _release(instance)  # the script moved it elsewhere: that move wins
        return wrapped(*args, **kwargs)
    if dtype is not None:
        wrapped(dtype=dtype)
    if memory_format is not None:
        wrapped(memory_format=memory_format)
    _release(instance)
    _report_held_device(type(instance))
    _held[instance] = (device, first_forward.watch(instance, _move_now))
    numel = sum(p.numel() for p in instance.parameters())
    notices.say(f"{_why}: {type(instance).__name__}.to({device}) before prepare() is held back: its {numel:,} weights "
                "stay in host memory, for prepare() to place them from there; a model that is not prepared goes "
                "to the card at prepare() or at its first use.",
                level=logging.INFO, once_key=("zero3_held_move", type(instance).__name__))
    return instance


def at_prepare(models):
    """prepare() under ZeRO-3 with ``models`` among its arguments: those are the engine's to place; every other
    held model goes where its script asked. Moves after this one pass through."""
    global _armed
    prepared = first_forward.module_ids(models)
    for model in list(_held.keys()):
        if id(model) in prepared:
            _release(model)
        else:
            _move_now(model)
    _armed = False


def hand_over(models):
    """prepare() of a streaming config: [(model, device)] of every held model not among ``models``, for the
    streaming to place; ``models`` are the engine's. Moves after this one pass through."""
    global _armed
    prepared = first_forward.module_ids(models)
    others = []
    for model in list(_held.keys()):
        if id(model) not in prepared:
            others.append((model, _held[model][0]))
        _release(model)
    _armed = False
    return others


def _move_now(model):
    global _moving
    if model not in _held:
        return
    device, _ = _held[model]
    _release(model)
    _moving = True
    try:
        model.to(device)
    finally:
        _moving = False


def _release(model):
    _, handles = _held.pop(model, (None, ()))
    first_forward.unwatch(handles)


_device_properties = {}  # class -> its original ``device`` property


def _report_held_device(cls):
    """The ``device`` property of diffusers' and transformers' models answers with the held device for a held model."""
    for owner in cls.__mro__:
        original = owner.__dict__.get("device")
        if isinstance(original, property) and owner not in _device_properties:
            _device_properties[owner] = original

            def device(self, _original=original):
                held = _held.get(self)
                return held[0] if held is not None else _original.fget(self)

            setattr(owner, "device", property(device, original.fset, original.fdel, original.__doc__))


def _is_model(module):
    return any(cls.__name__ in _MODEL_BASES for cls in type(module).__mro__)
