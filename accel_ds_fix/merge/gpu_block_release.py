"""Keep the GPU memory ZeRO-1/2 frees while it builds the engine from staying reserved.

ZeRO copies every fp16 parameter into one flat buffer and frees the per-parameter blocks; DeepSpeed 0.19.8
then clones that buffer on the GPU on its way to the CPU master weights (0.14.4 moved it to the CPU first).
The caching allocator cannot fit the clone into the freed (per-parameter sized) blocks, so it reserves a third
copy of the model: 5.54 GiB reserved for a 3.69 GiB peak with SD1.5 (docs/gpu.md). Handing the freed blocks
back right after the flattening keeps reserved memory at what is in use (3.70 GiB). Only while the fix's own
prepare() builds an engine: empty_cache() in every step would slow training.
"""

import contextlib
import threading

import torch

_building = threading.local()


@contextlib.contextmanager
def building_engine():
    previous = getattr(_building, "active", False)
    _building.active = True
    try:
        yield
    finally:
        _building.active = previous


def release_cached_blocks(device):
    if torch.cuda.is_available() and getattr(device, "type", device) == "cuda":
        torch.cuda.empty_cache()


def release_after_flatten(wrapped, instance, args, kwargs):
    """DeepSpeedZeroOptimizer._update_model_bit16_weights: the parameters now point into the flat buffer."""
    result = wrapped(*args, **kwargs)
    if getattr(_building, "active", False):
        release_cached_blocks(_flat_device(instance))
    return result


def _flat_device(optimizer):
    # optimizer.device is the CPU under optimizer offload; the flat buffers are where the model is.
    flat = getattr(optimizer, "bit16_groups_flat", None)
    return flat[-1].device if flat else None
