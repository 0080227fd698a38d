"""Textual inversion under ZeRO-3, refused in ``prepare()``: a model whose only trained weight is its input
embedding is a textual inversion, and every textual inversion script writes rows of that embedding after each step
(it puts back every token but the new ones: diffusers' textual_inversion.py and the advanced DreamBooth scripts'
``retract_embeddings``, kohya's train_textual_inversion.py). Under ZeRO-3 a weight above the persistence threshold
is a shape-[0] shard outside forward, so the script would train one step and die in that write with an IndexError
from deep inside itself. ZeRO-2 keeps the embedding whole (measured with the advanced Flux script: docs/validation.md)."""

import logging
import os

from .. import notices
from ..errors import ConfigError

ENV = "ACCEL_DS_FIX_ZERO3_TEXTUAL_INVERSION"
# DeepSpeed's default stage3_param_persistence_threshold (elements): smaller weights stay whole on every process
DEEPSPEED_PERSISTENCE_THRESHOLD = 100000


def _persistence_threshold(zero):
    value = zero.get("stage3_param_persistence_threshold", DEEPSPEED_PERSISTENCE_THRESHOLD)
    # "auto": accelerate fills in 10 x the hidden size, far below any vocabulary's embedding
    return value if isinstance(value, (int, float)) else 0


def _inverted_embedding(model):
    """The input embedding of ``model`` when it is the only weight that trains, else None."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    weight = getattr(embedding, "weight", None)
    if weight is None or not weight.requires_grad:
        return None
    trained = [p for p in model.parameters() if p.requires_grad]
    return weight if len(trained) == 1 and trained[0] is weight else None


def _elements(weight):
    return getattr(weight, "ds_numel", None) or weight.numel()  # a zero.Init shard knows its whole size


def _allowed():
    value = os.environ.get(ENV, "").strip().lower()
    if value not in ("", "allow", "refuse"):  # a typo must not pass for allow, nor be silently ignored
        notices.say(f"{ENV}={value!r} is not understood: use allow (let a textual inversion through under ZeRO-3) "
                    "or refuse (the default); refusing.", level=logging.WARNING, once_key=ENV)
    return value == "allow"


def refuse(models, labels, zero):
    """Raise before anything is allocated where a model of this ZeRO-3 ``prepare()`` is a textual inversion whose
    embedding ZeRO-3 would partition. ``ACCEL_DS_FIX_ZERO3_TEXTUAL_INVERSION=allow``: the script writes no rows
    (it masks the gradients with a hook) or writes them the ZeRO way, so let it through."""
    if _allowed():
        return
    threshold = _persistence_threshold(zero)
    for model, label in zip(models, labels):
        weight = _inverted_embedding(model)
        if weight is None:
            continue
        elements = _elements(weight)
        if elements <= threshold:
            continue
        raise ConfigError(
            f"accel_ds_fix: {label} trains only its input embedding ({elements:,} elements): a textual "
            "inversion, under DeepSpeed ZeRO stage 3. Textual inversion scripts write rows of that embedding after "
            "each step, putting back every token but the new ones (diffusers' textual_inversion.py and the advanced "
            "DreamBooth scripts' retract_embeddings, kohya's train_textual_inversion.py), and under ZeRO-3 the "
            "embedding is a shape-[0] shard outside forward: the script would train one step and then stop with an "
            "IndexError inside itself. Use ZeRO-2, which keeps the embedding whole: "
            "configs/accelerate_zero2_offload.yaml (`python -m accel_ds_fix plan` says whether it fits). If your "
            "script writes no embedding rows (it masks the gradients with a hook), or writes them with "
            f"deepspeed.utils.safe_set_full_fp32_param, set {ENV}=allow. docs/gradients-and-weights.md has both ways."
        )
