"""Which parameters DeepSpeed trains is fixed when prepare() builds the engine: its optimizer owns the
parameters that were trainable then. Scripts that turn ``requires_grad`` on or off later (text-encoder
embeddings in several LoRA scripts) get neither what they asked for nor a word about it, and DeepSpeed's
checkpoint then records the frozen parameters of save time but looks up those of load time (KeyError)."""

import contextlib
import logging

from .. import notices
from ..lookup import engine_record, merged_engine
from ..weights.partitioned import full_numel


def _optimized(param):
    # DeepSpeed's runtime.utils.is_optimized_parameter: trainable, with at least one element.
    return param.requires_grad and full_numel(param) > 0


def _stepped_whatever_the_gradient(engine):
    """Ids of the parameters DeepSpeed's optimizer holds in its flat groups (ZeRO-1/2/3, fp16/bf16): it steps
    each of them every step, with a zero gradient where none came. A plain torch optimizer (ZeRO-0, fp32) skips
    a parameter without gradient, as without DeepSpeed."""
    optimizer = getattr(engine, "optimizer", None)
    for attribute in ("bit16_groups", "fp16_groups", "bf16_groups"):
        groups = getattr(optimizer, attribute, None)
        if groups is not None:
            return {id(p) for group in groups for p in group}
    return set()


def remember(engine):
    """Record which parameters were trainable and which the engine's optimizer took (called right after
    prepare() built it)."""
    params = list(engine.module.parameters())
    record = engine_record(engine)
    record.trained = {id(p) for p in params if _optimized(p)}
    record.stepped = _stepped_whatever_the_gradient(engine)
    record.params = params
    record.flags = tuple(p.requires_grad for p in params)
    record.in_optimizer = None  # unknown until prepare() says (held_by)


def held_by(optimizer):
    """Ids of what the script's optimizer holds, frozen parameters too, read before DeepSpeed builds the engine
    (ZeRO replaces the optimizer's params with its flat partitions). A parameter outside it that the script makes
    trainable later is not updated without DeepSpeed either: diffusers' LoRA scripts turn the text encoders'
    embeddings on for gradient checkpointing."""
    groups = getattr(optimizer, "param_groups", None)
    return {id(p) for g in groups for p in g["params"]} if groups else None


def backward(wrapped, instance, args, kwargs):
    """Accelerator.backward: notice requires_grad changes made after prepare() (a flag comparison per step).
    With one engine per optimizer the loss goes to the engine it trains (backward_routing.py), and only that
    engine's flags count (TiTok freezes the discriminator during the generator's backward)."""
    from . import backward_routing

    if backward_routing.engines(instance):
        result, engine = None, backward_routing.backward(instance, *args, **kwargs)
    else:
        result, engine = wrapped(*args, **kwargs), merged_engine(instance)
    record = engine_record(engine, create=False) if engine is not None else None
    if record is not None and record.params is not None and not record.trainability_said:
        flags = tuple(p.requires_grad for p in record.params)
        if flags != record.flags:
            record.flags = flags
            warn_if_changed(engine)
    return result


def frozen_names(merged):
    """Names (``models.<name>.<param>``) of the parameters DeepSpeed's checkpoint stores as frozen right now."""
    return [n for n, p in merged.named_parameters() if not _optimized(p)]


def _changed(engine):
    """Names of the parameters made trainable after prepare() that the script's optimizer holds, of those frozen
    after it that DeepSpeed's optimizer still steps, and of the changes that alter nothing (frozen ones it does not
    step; trainable ones outside the script's optimizer)."""
    record = engine_record(engine, create=False)
    if record is None or record.trained is None:
        return [], [], []
    trained, stepped, in_optimizer = record.trained, record.stepped, record.in_optimizer
    turned_on, turned_off, harmless = [], [], []
    for name, param in engine.module.named_parameters():
        if full_numel(param) == 0:
            continue
        was_trainable = id(param) in trained
        if param.requires_grad and not was_trainable:
            if in_optimizer is not None and id(param) not in in_optimizer:
                harmless.append(name)  # no optimizer of the script's would update it, with DeepSpeed or without
            else:
                turned_on.append(name)
        elif was_trainable and not param.requires_grad:
            (turned_off if id(param) in stepped else harmless).append(name)
    return turned_on, turned_off, harmless


def _listed(names):
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def warn_if_changed(engine):
    """Say once per engine when parameters changed requires_grad after prepare()."""
    record = engine_record(engine)
    if record.trainability_said:
        return
    turned_on, turned_off, harmless = _changed(engine)
    if harmless and not record.harmless_said:
        record.harmless_said = True
        # kohya's train_network.py freezes the UNet and text encoder after prepare(): nothing to warn about.
        notices.logger.debug(
            "%d parameter(s) changed requires_grad after accelerator.prepare() (%s): no optimizer steps them, "
            "with DeepSpeed or without, so this changes nothing", len(harmless), _listed(harmless))
    if not (turned_on or turned_off):
        return
    record.trainability_said = True
    parts = []
    if turned_on:
        parts.append(
            f"{len(turned_on)} parameter(s) were made trainable after accelerator.prepare() ({_listed(turned_on)}): "
            "DeepSpeed's optimizer does not own them, so they are not updated"
        )
    if turned_off:
        parts.append(
            f"{len(turned_off)} parameter(s) were frozen after accelerator.prepare() ({_listed(turned_off)}): "
            "DeepSpeed's optimizer still owns and steps them"
        )
    notices.say(
        "; ".join(parts) + ". DeepSpeed fixes the trained parameters when prepare() builds the engine: set "
        "requires_grad on every parameter before accelerator.prepare() (and put the trainable ones in the "
        "optimizer). Checkpoints still save and resume.",
        level=logging.WARNING,
    )


@contextlib.contextmanager
def as_saved(merged, frozen_at_save):
    """While DeepSpeed loads a checkpoint, freeze exactly the parameters that were frozen when it was saved.

    DeepSpeed stores the frozen parameters at save time and, on load, looks up every parameter frozen at load
    time; a parameter whose requires_grad changed in between would raise KeyError halfway through the load.
    """
    if frozen_at_save is None:  # a checkpoint of an earlier format: DeepSpeed's own behaviour
        yield
        return
    frozen_at_save = set(frozen_at_save)
    flipped = []
    for name, param in merged.named_parameters():
        if full_numel(param) == 0:
            continue  # always stored as frozen, whatever requires_grad says
        should_train = name not in frozen_at_save
        if param.requires_grad != should_train:
            param.requires_grad_(should_train)
            flipped.append(param)
    try:
        yield
    finally:
        for param in flipped:
            param.requires_grad_(not param.requires_grad)
