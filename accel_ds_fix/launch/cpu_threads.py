"""CPU threads for DeepSpeed's CPU optimizer: optimizer offload steps every parameter on the host, in OpenMP
threads, and torchrun (which `accelerate launch` uses for DeepSpeed) sets OMP_NUM_THREADS=1 for each of several
processes unless the variable is set; accelerate's own --num_cpu_threads_per_process does not reach DeepSpeed's
launcher."""

import logging
import os

from .. import notices


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
        f"torchrun, which accelerate launch uses for DeepSpeed, sets OMP_NUM_THREADS=1 for several processes "
        f"unless it is set: launch with OMP_NUM_THREADS={cores} in the environment "
        f"(--num_cpu_threads_per_process does not reach DeepSpeed's launcher).",
        level=logging.WARNING,
        once_key="threads",
    )
