"""CPU threads for DeepSpeed's CPU optimizer: optimizer offload steps every parameter on the host, in
OpenMP threads, and `accelerate launch` / torchrun set OMP_NUM_THREADS=1 unless told otherwise."""

import logging
import os

from . import notices


def cores_per_process():
    """CPU cores this process may use, shared among the processes of this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, cores // max(1, local_processes))


def warn_if_few_for_cpu_optimizer():
    """Say once when the CPU optimizer would run on fewer threads than the cores this process has."""
    import torch

    threads, cores = torch.get_num_threads(), cores_per_process()
    if threads >= cores:
        return
    notices.say(
        f"DeepSpeed's CPU optimizer (optimizer offload) will step on {threads} CPU thread(s), but this process "
        f"may use {cores} cores, which makes every optimizer step slower (docs/gpu.md measures it). "
        f"accelerate launch and torchrun set OMP_NUM_THREADS=1 unless told otherwise: pass "
        f"--num_cpu_threads_per_process {cores} to accelerate launch, or set OMP_NUM_THREADS={cores}.",
        level=logging.WARNING,
        once_key="threads",
    )
