"""prepare()'s part of the streaming tier: which frozen blocks stream, their host copies, and the engine built
without them (DeepSpeed would otherwise move, cast and broadcast every weight of the module: the whole base onto
the card). Models the script moved to the card before prepare() without preparing them (Flux's T5, the VAE; held
back as under ZeRO-3) are placed here too: what the card's budget holds goes to the card, the rest streams."""

import contextlib
import logging
import weakref

import torch

from .. import notices
from ..deepspeed_config import STREAM_ALLOCATOR_SLACK, streaming as streaming_settings
from ..units import size_in_words
from . import blocks as found_blocks, hooks
from .host_memory import HostMemory
from .streamer import Streamer

streamers = weakref.WeakSet()  # every streamer of this process (the tests and `report` read their counters)


def _card_capacity(device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = (torch.cuda.get_per_process_memory_fraction(index)
                if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0)
    return int(total * fraction)


def _bytes(p, dtype):
    return p.numel() * torch.empty((), dtype=dtype).element_size()


def _on_card_budget(settings, device, everything, candidates, engine_bytes, prefetch):
    """Bytes of frozen blocks the card keeps: the config's number, or (auto) the card's capacity less what is on it
    now, what the engine and the rest of the models will put there, the reserve, and the blocks in flight."""
    if settings.on_card is not None:
        return settings.on_card, "the config's frozen_on_card_gib"
    if device.type != "cuda":
        return float("inf"), "no card: nothing streams unless frozen_on_card_gib says how much stays"
    rest = everything - sum(b.nbytes for b in candidates)
    in_flight = (prefetch + 1) * max((b.nbytes for b in candidates), default=0)
    # what the caching allocator keeps beside the allocated comes off the card first (as `plan` counts it)
    budget = (int(_card_capacity(device) / STREAM_ALLOCATOR_SLACK) - torch.cuda.memory_allocated(device) - rest
              - engine_bytes - settings.reserve - in_flight)
    return max(0, budget), (f"what the card leaves beside {size_in_words(settings.reserve)} for activations "
                            f"(card_reserve_gib) and {size_in_words(rest + engine_bytes)} of trained weights, engine "
                            f"buffers and other weights")


def name_in_engine(engine):
    """The engine took its parameters' names while the streamed ones were out of the module; its checkpoints look
    every parameter up by them (frozen_param_shapes)."""
    engine.param_names = {param: name for name, param in engine.module.named_parameters()}


def _slots(block):
    """(owner module, attribute name) of each streamed parameter of ``block``."""
    where = {}
    for owner in block.module.modules():
        for leaf, p in owner._parameters.items():
            if p is not None:
                where.setdefault(id(p), (owner, leaf))
    return [where[id(p)] for p in block.params]


def keep_first(by_model):
    """The blocks in the order the card keeps them ([(blocks, prepared)] in prepare()'s order, the models held beside
    them last): what computes least for its bytes first, as its copies would have least to hide behind. The
    prepared models but the largest (the text encoders: their blocks would cross twice a step, for a prompt of 77
    tokens), then the models beside (Flux's and SD3's T5, the VAE: once a step), then the largest prepared model
    (the denoiser, thousands of tokens, whose computation hides its copies in the backward), so that what streams is
    the denoiser's last blocks (docs/how-it-works.md; docs/gpu.md run 19: SD3.5-large's CLIP-L and CLIP-G streamed
    behind its T5 made 167 loads a step, 1.7x the uncapped step)."""
    def size(blocks):
        return sum(b.nbytes for b in blocks)

    prepared = [blocks for blocks, is_prepared in by_model if is_prepared]
    beside = [blocks for blocks, is_prepared in by_model if not is_prepared]
    largest = max(prepared, key=size) if prepared else []
    smaller = sorted((blocks for blocks in prepared if blocks is not largest), key=size)
    return [b for blocks in smaller + beside + [largest] for b in blocks]


@contextlib.contextmanager
def while_engine_is_built(models, labels, others, config, dtype, device, engine_bytes=0, prefetch=1):
    """Around the engine's build under a streaming config: ``models`` (prepared, trained in ``dtype``) and
    ``others`` ([(model, device)]: held moves of models not prepared) get their blocks' host copies; what streams
    is out of the modules while the engine is built and the other models are moved, then back as empty tensors on
    the card, loaded when used."""
    settings = streaming_settings(config)
    if not settings.enabled:
        yield None
        return
    device = torch.device(device)
    by_model, final = [], {}
    everything = 0
    for model, label in list(zip(models, labels)) + [(m, type(m).__name__) for m, _ in others]:
        kind = dtype if any(model is m for m in models) else None
        for p in model.parameters():
            final[id(p)] = kind or p.dtype
            everything += _bytes(p, final[id(p)])
        by_model.append((found_blocks.find(model, label, lambda p: _bytes(p, final[id(p)])), kind is not None))
    candidates = keep_first(by_model)
    on_card, why = _on_card_budget(settings, device, everything, candidates, engine_bytes, prefetch)
    resident, streamed = found_blocks.split(candidates, on_card)
    streamer = Streamer(device, prefetch)
    memory = HostMemory(pinned=device.type == "cuda")
    removed = []
    for block in streamed:
        block.hosts = []
        block.slots = _slots(block)
        for p, (owner, leaf) in zip(block.params, block.slots):
            host = memory.like(p, final[id(p)])
            with torch.no_grad():
                host.copy_(p.data)
            block.hosts.append(host)
            # empty on the card until loaded: one allocation, then its storage released
            p.data = torch.empty(p.shape, dtype=final[id(p)], device=device)
            p.untyped_storage().resize_(0)
            del owner._parameters[leaf]
            removed.append((owner, leaf, p))
    streamed_bytes = sum(b.nbytes for b in streamed)
    resident_bytes = sum(b.nbytes for b in resident)
    try:
        for model, target in others:
            model.to(target)
        yield streamer
    finally:
        for owner, leaf, p in removed:
            owner._parameters[leaf] = p
    for block in streamed:
        hooks.attach(streamer, block)
    streamer.blocks = streamed
    streamer.host_bytes = memory.nbytes
    streamers.add(streamer)
    if not candidates:
        what = ("the prepared models have no frozen layers (a full fine-tune): nothing streams, and the tier trains "
                "as zero2-offload does")
    elif not streamed:
        what = (f"all {len(candidates)} frozen blocks ({size_in_words(resident_bytes)}) stay on the card ({why}): "
                "nothing streams")
    else:
        what = (f"{len(streamed)} of {len(candidates)} frozen blocks ({size_in_words(streamed_bytes)}) stay in "
                f"{'pinned ' if memory.pinned else ''}host memory and are copied to the card ahead of each use; "
                f"{size_in_words(resident_bytes)} of frozen blocks stay on the card ({why})")
    notices.say(f"streaming frozen weights: {what}.", level=logging.INFO)
