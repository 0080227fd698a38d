"""ZeRO-3 with several processes: a forward of a merged model on one process alone is named, not waited on.

diffusers' scripts validate on the main process alone (``if accelerator.is_main_process:`` ... ``log_validation``
with the prepared transformer and text encoders in a pipeline). Under ZeRO-3 every weight is a shard outside forward
and the forward gathers it from every process, a collective: the main process waited there for processes that
trained on into their next step's gathers. Before a merged model's forward without gradients (validation runs under
torch.no_grad), each process marks its arrival; one that waits FORWARD_ALONE_S (ACCEL_DS_FIX_WAIT_S) for the others
stops with what to do.
Training forwards (gradients on) are left alone: every process runs them."""

import torch

from ..errors import ConfigError
from ..processes import every_process

# All processes run a forward together within seconds; a longer wait is a forward that runs on one process.
FORWARD_ALONE_S = 120


_armed = False  # a ZeRO-3 prepare() merged models with several processes


def watch(models):
    """A check before each forward of ``models`` without gradients, ahead of DeepSpeed's own hooks (a pipeline
    calls the models unwrapped); check() does the same for a call through a proxy, before the engine."""
    global _armed
    if not every_process.several_processes():
        return
    _armed = True
    for model in models:
        model.register_forward_pre_hook(_before_forward, prepend=True)


def _before_forward(module, args):
    check(module)


def check(module):
    if not _armed or torch.is_grad_enabled():
        return
    limit = every_process.wait_s(FORWARD_ALONE_S)
    absent = every_process.missing("forward", limit)
    if absent:
        raise ConfigError(
            f"accel_ds_fix: {type(module).__name__} runs a forward (without gradients: a validation?) on process "
            f"{every_process.rank()}, and process(es) {', '.join(map(str, absent))} did not run it within "
            f"{limit:.0f} s. Under ZeRO-3 each weight is partitioned across the processes and a forward gathers "
            "it from all of them, so a forward on one process alone would wait forever. The script validates on the "
            "main process only (diffusers' scripts: `if accelerator.is_main_process:` around log_validation). "
            "Train without --validation_prompt, with one process, or with ZeRO-2 "
            "(configs/accelerate_zero2_offload.yaml), whose processes each hold the whole weights."
        )
