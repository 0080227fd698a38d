"""The card's copy bandwidth from pinned host memory: what sets the streaming tier's floor (a step takes at least
the bytes it streams over it). `plan` measures it where it finds a card and is not told (--h2d-gbps)."""

import time


def measure_gbps(mib=512, repeats=3):
    """GB/s of one copy of ``mib`` MiB from pinned host memory to the first card, the best of ``repeats``; None
    without a card."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = mib * 2**20
    source = torch.ones(n, dtype=torch.uint8).pin_memory()
    target = torch.empty(n, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    del source, target
    torch.cuda.empty_cache()
    return n / best / 1e9
