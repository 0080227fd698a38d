"""Accelerator.end_training under DeepSpeed. Since accelerate 0.34 it destroys the process group, and kohya's
scripts call it before their final save_state() and model save, which DeepSpeed's checkpointing and ZeRO-3's
gathering need: the final state and weights of the run were lost (with or without this package). Once a model
is prepared for DeepSpeed (merged models, or kohya's --deepspeed wrapper) the group is destroyed when the process
exits instead; everything else end_training does happens now."""

import atexit

import torch

from ..lookup import uses_deepspeed

_registered = False


def _destroy_at_exit():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _defer(group=None):
    global _registered
    if not _registered:
        atexit.register(_destroy_at_exit)
        _registered = True


def end_training(wrapped, instance, args, kwargs):
    if not (uses_deepspeed(instance) and instance._models):
        return wrapped(*args, **kwargs)
    state = instance.state
    state.destroy_process_group = _defer  # shadows the method for this call only
    try:
        return wrapped(*args, **kwargs)
    finally:
        del state.destroy_process_group
