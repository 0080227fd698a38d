"""save_state called on the main process alone, with several processes: saved a moment later by every process.

diffusers' DreamBooth scripts up to v0.40 call ``accelerator.save_state`` under ``if accelerator.is_main_process:``.
Each process writes its own part of a DeepSpeed checkpoint, so the main process would wait forever for the others,
which trained on into their next step. Instead the main process notes the folder and returns; at the next point
that every process reaches in the same order (a merged model's training forward, ``wait_for_everyone()``,
``end_training()``) the main process says in the process group's key-value store whether a save is due, the others
read it there, and all of them save it together before going on. The weights, optimizer and scheduler are those
of the script's line (no step has run since); the random states each process saves are the ones it had after its
last backward (taken there while a save may be handed on), not the ones the next step has drawn from since, so a
resume draws as the run went on. The checkpoint is whole a moment later than the script's line; a crash in between
leaves the previous one."""

import contextlib
import datetime
import logging
import random
import weakref

import numpy
import torch

from .. import notices
from . import every_process

_accelerator = None  # weak reference to the Accelerator whose merged models are watched
_pending = None  # on the main process: the folder a save_state on it alone asked for
_counts = {}  # sync point kind -> how many times this process reached it
_saving = False  # the deferred save runs: save_state must not wait for the others, they are all here
_rng_after_backward = None  # this process's random states after its last backward, while armed


def arm(accelerator):
    """Called at a prepare() that merged models, with several processes: start syncing at every training step."""
    global _accelerator
    if every_process.several_processes():
        _accelerator = weakref.ref(accelerator)


def is_running():
    return _saving


def defer(target):
    """On the main process, for a save_state the others did not call: save it at the next sync point. Returns
    False where that cannot be (not armed, or not the main process)."""
    global _pending
    if _accelerator is None or _accelerator() is None or every_process.rank() != 0:
        return False
    _pending = target
    notices.say(f"save_state({target}) was called on the main process alone, and under DeepSpeed every process "
                "writes its part of the checkpoint: it is written by all of them at the next training step's "
                "first forward (or wait_for_everyone() / end_training()), whole from then on.",
                level=logging.WARNING, once_key="deferred_save")
    return True


def sync(kind):
    """Every process, at a point all reach in the same order: run a save the main process deferred."""
    global _pending, _saving
    accelerator = _accelerator() if _accelerator is not None else None
    if accelerator is None or _saving:  # not armed: one process, or no merged models (every forward passes here)
        return
    store, rank, _ = every_process.process_store()
    if store is None:
        return
    _counts[kind] = _counts.get(kind, 0) + 1
    key = f"accel_ds_fix/deferred_save/{kind}/{_counts[kind]}"
    if rank == 0:
        target, _pending = _pending, None
        store.set(key, target or "")
    else:
        target = _wait_for(store, key).decode() or None
    if target is None:
        return
    _saving = True
    try:
        with _random_states(_rng_after_backward):
            accelerator.save_state(target)
    finally:
        _saving = False


def _wait_for(store, key):
    """The main process's word, however long it takes (validation on it alone may run for minutes under ZeRO-2),
    as a collective would wait: the store's own timeout is not an error here."""
    while True:
        try:
            store.wait([key], datetime.timedelta(seconds=600))
            return store.get(key)
        except RuntimeError as exc:  # "Socket Timeout" / "Wait timeout": ask again
            if "imeout" not in str(exc):
                raise


def _take_random_states():
    states = {"python": random.getstate(), "numpy": numpy.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _put_random_states(states):
    random.setstate(states["python"])
    numpy.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


@contextlib.contextmanager
def _random_states(states):
    """The random states ``states`` while the save reads them; the current ones again after."""
    if states is None:
        yield
        return
    now = _take_random_states()
    _put_random_states(states)
    try:
        yield
    finally:
        _put_random_states(now)


def after_backward(wrapped, instance, args, kwargs):
    """Accelerator.backward: the random states a save handed on will record (the script's save_state line comes
    after the step, before anything draws again)."""
    global _rng_after_backward
    result = wrapped(*args, **kwargs)
    if _accelerator is not None:
        _rng_after_backward = _take_random_states()
    return result


def at_training_forward():
    if torch.is_grad_enabled():  # validation forwards run on the main process alone, without gradients
        sync("forward")


def before_barrier(wrapped, instance, args, kwargs):
    """Accelerator.wait_for_everyone (outermost: the deferred save runs before the barrier and the copies
    read_alone takes after it)."""
    sync("barrier")
    return wrapped(*args, **kwargs)


def before_end(wrapped, instance, args, kwargs):
    """Accelerator.end_training: a save still due runs while the process group is there."""
    sync("end")
    return wrapped(*args, **kwargs)
