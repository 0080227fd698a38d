"""Inside the fix's prepare(), before DeepSpeed allocates anything: will this training fit the GPU, the host
memory and (for NVMe offload) the disk? If not, one error that says needed against available, in GiB, and
which shipped tiers would fit, instead of the kernel's OOM killer hours later with nothing saved.

ACCEL_DS_FIX_MEMORY_CHECK=warn turns the error into a warning (for users who know better); =off skips it.
The GPU side leaves activations out (only the script knows them): it stops only what cannot fit even so.
"""

import dataclasses
import logging
import os

import torch

from .. import deepspeed_config, notices
from ..errors import MemoryPlanError, PrerequisiteError
from ..nvme import prerequisites as nvme_prerequisites, swap_folder
from ..weights.partitioned import full_numel
from . import model as memory_model
from .hidden_size import hidden_size_of

ENV = "ACCEL_DS_FIX_MEMORY_CHECK"
GIB = memory_model.GIB


def _proc_bytes(path, key):
    """The ``key:  N kB`` line of a /proc file, in bytes; None where there is none (no /proc: not Linux)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _meminfo(key):
    return _proc_bytes("/proc/meminfo", key)


def _rss():
    return _proc_bytes("/proc/self/status", "VmRSS")


def available_host_bytes():
    """What the kernel says can still be allocated without swapping (MemAvailable); None without /proc."""
    return _meminfo("MemAvailable")


def workload_of(models, optimizer=None):
    params = {id(p): p for m in models for p in m.parameters()}.values()
    trainable = [p for p in params if p.requires_grad]
    if isinstance(optimizer, torch.optim.Optimizer):  # DeepSpeed trains what the optimizer holds, no more
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        trainable = [p for p in trainable if id(p) in held]
    total = sum(full_numel(p) for p in params)
    weight_bytes = round(sum(full_numel(p) * p.element_size() for p in params) / total) if total else 4
    groups, sizes = (), ()
    if isinstance(optimizer, torch.optim.Optimizer):
        sizes = tuple(
            s for s in (tuple(full_numel(p) for p in group["params"] if p.requires_grad) for group in optimizer.param_groups) if s
        )
        groups = tuple(sum(s) for s in sizes)
    return memory_model.Workload(
        params=total,
        trainable=sum(full_numel(p) for p in trainable),
        largest_trainable=max((full_numel(p) for p in trainable), default=0),
        largest_weight=max((full_numel(p) for p in params), default=0),
        weight_bytes=weight_bytes,
        groups=groups,
        param_sizes=sizes,
    )


def _gib(nbytes):
    return f"{nbytes / GIB:.1f} GiB"


class Capacity:
    """What this process can still use: GPU (bytes or None), host (bytes or None), and the memory it holds."""

    def __init__(self, accelerator, models):
        self.device = accelerator.device.type
        self.rss, available = _rss(), available_host_bytes()
        self.host = self.rss + available if self.rss is not None and available is not None else None
        self.on_host = sum(full_numel(p) * p.element_size() for m in models for p in m.parameters() if p.device.type == "cpu")
        self.gpu = None
        if self.device == "cuda":
            index = accelerator.device.index if accelerator.device.index is not None else torch.cuda.current_device()
            free, total = torch.cuda.mem_get_info(index)
            fraction = torch.cuda.get_per_process_memory_fraction(index) if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
            self.gpu = min(total * fraction, torch.cuda.memory_reserved(index) + free)

    def host_needed(self, prediction):
        """The process's peak: what it holds now without the models (at least what a CUDA training process
        holds once its libraries are loaded), plus the larger of the models' weights and DeepSpeed's buffers."""
        deepspeed = prediction.host  # predicted with a zero baseline
        if self.device == "cpu":
            return self.rss - self.on_host + deepspeed
        return max(self.rss - self.on_host, memory_model.HOST_BASELINE["cuda"]) + max(self.on_host, deepspeed)

    def shortfalls(self, prediction):
        problems = []
        if self.host is not None:
            need = self.host_needed(prediction)
            if need > self.host:
                problems.append(f"host memory: about {_gib(need)} needed at the peak, {_gib(self.host)} available "
                                f"({_gib(self.rss)} this process holds + {_gib(self.host - self.rss)} free)")
        if self.gpu is not None and prediction.gpu_reserved > self.gpu:
            problems.append(f"GPU memory: at least {_gib(prediction.gpu_reserved)} needed before activations, "
                            f"{_gib(self.gpu)} available to this process")
        return problems


def _fitting_tiers(work, accelerator, capacity, hidden):
    from .tiers import TIERS

    fitting = []
    for tier in TIERS:
        settings = memory_model.Settings.from_config(tier.deepspeed_config(), accelerator.mixed_precision,
                                               accelerator.num_processes, hidden)
        if not capacity.shortfalls(memory_model.predict(work, settings, capacity.device, host_baseline=0)):
            fitting.append(tier)
    return fitting


def runnable_tiers_sentence(work, accelerator, capacity, hidden):
    """Which shipped tiers fit this machine's memory and have what they need here, as a sentence."""
    runnable = [t for t in _fitting_tiers(work, accelerator, capacity, hidden)
                if not nvme_prerequisites.problems(t.deepspeed_config())]
    if not runnable:
        return "None of the shipped configs runs here either: train fewer parameters (LoRA), or on a larger machine"
    return "Shipped configs that run here: " + ", ".join(f"{t.name} (configs/{t.yaml_name})" for t in runnable)


def check_prerequisites(models, optimizer, config, accelerator):
    """A config that offloads to NVMe: stop before anything is allocated when this machine cannot run it (or
    its accel_ds_fix section is not understood)."""
    deepspeed_config.budget_bytes(config)  # ConfigError for a value that is not a budget
    work = workload_of(models, optimizer)
    largest = memory_model.largest_sub_group(work, memory_model.Settings.from_config(config))
    problems = nvme_prerequisites.problems(config, load=True, largest_sub_group=largest)
    if not problems:
        # this process's swap folders: another live run there is refused, a dead run's files go (room for ours)
        swap_folder.take([f for f in deepspeed_config.nvme_folders(config) if f], accelerator.process_index,
                         accelerator.num_processes, lambda line: notices.say(line, level=logging.WARNING))
        return
    hidden = max(hidden_size_of(m) for m in models)
    tiers = runnable_tiers_sentence(work, accelerator, Capacity(accelerator, models), hidden)
    raise PrerequisiteError(
        f"accel_ds_fix: this DeepSpeed config offloads to NVMe, which cannot run here: {'; '.join(problems)}. "
        f"{tiers}; `python -m accel_ds_fix plan` shows each with its numbers. Nothing was allocated."
    )


MODES = {"error": ("error", "1", "true", "yes", "on"), "warn": ("warn",), "off": ("off", "0", "false", "no")}


def check_mode():
    """error (the default), warn or off: what ACCEL_DS_FIX_MEMORY_CHECK asks of every memory check."""
    value = os.environ.get(ENV, "error")
    chosen = next((m for m, spellings in MODES.items() if value.strip().lower() in spellings), None)
    if chosen is None:  # a typo must not silently change what happens: say so, and check as by default
        notices.say(f"{ENV}={value!r} is not understood: use error (the default), warn or off; checking as error.",
                    level=logging.WARNING, once_key=ENV)
        return "error"
    return chosen


def stop_or_warn(mode, message, error):
    """What every memory check does with a shortfall: raise ``error`` (mode "error") or say ``message`` ("warn")."""
    if mode == "warn":
        notices.say(message, level=logging.WARNING)
    else:
        raise error(message)


def check_before_allocating(plan, config, accelerator):
    mode = check_mode()
    if mode == "off" or accelerator.device.type not in ("cuda", "cpu"):
        return
    optimizer = plan.optimizers[0] if plan.optimizers else None
    work = workload_of(plan.models, optimizer)
    hidden = max(hidden_size_of(m) for m in plan.models)
    settings = memory_model.Settings.from_config(config, accelerator.mixed_precision, accelerator.num_processes, hidden)
    prediction = memory_model.predict(work, settings, accelerator.device.type, host_baseline=0)
    capacity = Capacity(accelerator, plan.models)
    room, room_warnings = nvme_prerequisites.room_problems(config, prediction.nvme,
                                                           memory_model.checkpoint_bytes(work, settings))
    for warning in room_warnings:
        notices.say(warning, level=logging.WARNING)
    problems = capacity.shortfalls(prediction) + room
    if not problems:
        return
    tiers = runnable_tiers_sentence(work, accelerator, capacity, hidden)
    _, kept_bytes = memory_model.kept_in_ram(work, settings, accelerator.device.type)
    if kept_bytes and capacity.host is not None and capacity.host_needed(prediction) > capacity.host:
        without = memory_model.predict(work, dataclasses.replace(settings, nvme_ram=0), accelerator.device.type,
                                       host_baseline=0)
        room = capacity.host - capacity.host_needed(without)
        what = (f"of the host memory, {_gib(kept_bytes)} are the optimizer sub groups the config keeps off the disk "
                f"({deepspeed_config.SECTION}.{deepspeed_config.KEY}: {settings.nvme_ram / GIB:g})")
        problems.append(f"{what}: set it to {room // (GIB // 4) / 4:g} (slower steps, the same training)" if room >= 0
                        else f"{what}, and even with none kept the rest needs about {_gib(-room)} more")
    message = (
        f"accel_ds_fix: this training will not fit: {'; '.join(problems)}. The DeepSpeed config (ZeRO stage "
        f"{settings.stage}, optimizer offload {settings.offload_optimizer}, parameter offload "
        f"{settings.offload_param}) needs that for {work.params / 1e6:.1f}M parameters, {work.trainable / 1e6:.1f}M "
        f"trainable. {tiers}; `python -m accel_ds_fix plan` shows each with its numbers. Nothing was allocated. "
        f"Set {ENV}=warn to go on anyway."
    )
    stop_or_warn(mode, message, MemoryPlanError)
