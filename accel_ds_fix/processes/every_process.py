"""Every process must call save_state under DeepSpeed, and the ones that don't are named instead of waited for.

Each process writes its own part of a DeepSpeed checkpoint (its optimizer partition; under ZeRO-3 its weights
too), so the save is collective. A script that saves on the main process only (diffusers' DreamBooth scripts up to
v0.40 put ``if accelerator.is_main_process:`` above ``accelerator.save_state``; their SD3 LoRA script adds ``or
accelerator.distributed_type == DistributedType.DEEPSPEED``) would leave the main process waiting forever in the
save's first collective while the others train on into theirs. Before any collective, each process marks its
arrival in the process group's key-value store and waits there for the others, with a timeout and their ranks.
``missing()`` is that arrival check for any collective step a script may run on one process (read_alone.py)."""

import logging
import os
import time

from .. import notices
from ..errors import CheckpointError

ENV = "ACCEL_DS_FIX_WAIT_S"  # how long a process waits for the others at a step all must run, before naming them
# The processes leave the optimizer step together; what a script does on the main process alone before saving
# (deleting checkpoints beyond a limit) may take a while on a slow disk.
SAVE_WAIT_S = 300
# A save_state on the main process that the others have not joined by then is handed on (deferred_save.py): the
# processes leave the optimizer step together, so a call on every process arrives within moments.
DEFER_AFTER_S = 10
NOTICE_AFTER_S = 30

_calls = {}  # what -> how many times this process got there


def several_processes():
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def process_store():
    import torch.distributed as dist

    if not several_processes():
        return None, 0, 1
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store(), dist.get_rank(), dist.get_world_size()
    except (ImportError, RuntimeError, ValueError):  # a torch without it: DeepSpeed's own collective waits instead
        return None, 0, 1


def wait_s(default):
    """ACCEL_DS_FIX_WAIT_S, else ``default`` seconds."""
    value = os.environ.get(ENV, "")
    try:
        return float(value) if value.strip() else default
    except ValueError:
        notices.say(f"{ENV}={value!r} is not understood: use a number of seconds; waiting {default} s.",
                    level=logging.WARNING, once_key=ENV)
        return default


def missing(what, limit_s, waiting_notice=None):
    """The ranks of the processes that do not reach this point (the n-th ``what`` of each) together with this one:
    those not there within ``limit_s`` seconds, or, for one that comes after another gave up waiting, that one (so
    that the processes decide alike). Empty once all are there, or with one process. ``waiting_notice(missing)``:
    said once after 30 s."""
    store, rank, world = process_store()
    if store is None:
        return []
    _calls[what] = _calls.get(what, 0) + 1
    prefix = f"accel_ds_fix/{what}/{_calls[what]}"
    gave_up = f"{prefix}/gave_up"
    store.set(f"{prefix}/{rank}", "1")
    keys = [f"{prefix}/{r}" for r in range(world)]
    start, said = time.monotonic(), False
    while not store.check(keys):
        if store.check([gave_up]):
            return [int(store.get(gave_up))]
        waited = time.monotonic() - start
        absent = [r for r in range(world) if not store.check([keys[r]])]
        if waited > limit_s:
            store.set(gave_up, str(rank))
            return absent
        if waiting_notice and waited > NOTICE_AFTER_S and not said:
            notices.say(waiting_notice(absent), level=logging.WARNING)
            said = True
        time.sleep(0.05)
    return [int(store.get(gave_up))] if store.check([gave_up]) else []


def rank():
    return process_store()[1]


def wait_for_all(target, defer=None):
    """Return True once every process has called save_state as often as this one. ``defer(target)``: on the main
    process, after DEFER_AFTER_S alone, hand the save to the next step where all are (deferred_save.py) and return
    False (a process that comes later returns False too). Otherwise raise CheckpointError naming the missing
    processes after ACCEL_DS_FIX_WAIT_S seconds (300), before anything is written."""
    limit, here = wait_s(SAVE_WAIT_S), rank()
    deferring = defer is not None and here == 0
    if deferring:
        limit = min(limit, DEFER_AFTER_S)

    def waiting(absent):
        return (f"save_state({target}) on process {here} has waited {NOTICE_AFTER_S} s for process(es) "
                f"{_ranks(absent)} to call save_state too (under DeepSpeed every process must); giving up after "
                f"{limit:.0f} s ({ENV}).")

    absent = missing("save_state", limit, waiting)
    if not absent:
        return True
    if deferring and defer(target):
        return False
    if absent == [0] and here != 0:
        # came after the main process gave up: it handed the save on (it runs with all of them), or it stopped
        # the run with this error itself
        return False
    raise CheckpointError(_missing_message(target, here, absent, limit))


def _ranks(ranks):
    return ", ".join(str(r) for r in ranks)


def _missing_message(target, rank, missing, limit):
    return (
        f"accel_ds_fix: save_state({target}) was called on process {rank} but not on process(es) {_ranks(missing)} "
        f"within {limit:.0f} s. Under DeepSpeed each process writes its own part of the checkpoint (its optimizer "
        "partition), so every process must call save_state, or the ones that do wait forever. The script most "
        "likely saves on the main process only: diffusers' DreamBooth scripts up to v0.40 have `if "
        "accelerator.is_main_process:` above `accelerator.save_state(save_path)`. Change that line to `if "
        "accelerator.is_main_process or accelerator.distributed_type == DistributedType.DEEPSPEED:` (as diffusers' "
        "train_dreambooth_lora_sd3.py does), or train on one process. Nothing of this checkpoint was written; "
        f"{ENV} sets the wait."
    )

