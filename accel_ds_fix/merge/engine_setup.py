"""What every DeepSpeed engine that holds merged models gets once accelerate has built it, whether it is the one
engine of a prepare() call or one of several (one per optimizer): a proxy per model, the record of what it trains,
the fixes that need the built engine, and ZeRO's freed blocks released."""

from ..lookup import engine_record
from ..weights.full_weights import add_full_weight_hooks
from . import gpu_block_release, spectral_norm_dtype, trainability
from .proxy import ModelProxy


def adopt(engine, names, models):
    """Return {name: proxy} for ``models`` (merged in ``engine`` under ``names``)."""
    proxies = {name: ModelProxy(model, engine, name) for name, model in zip(names, models)}
    engine_record(engine).proxies = proxies
    trainability.remember(engine)
    spectral_norm_dtype.match_buffers_to_weights(engine.module)
    # What construction freed after the hook's last release (ZeRO-2's partition clone, ZeRO-3's gathers) goes back.
    gpu_block_release.release_cached_blocks(getattr(engine, "device", None))
    add_full_weight_hooks(models)  # state_dict() gives full, separate tensors (ZeRO-3: never shape [0])
    return proxies
