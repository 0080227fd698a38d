"""The card's copy bandwidth from host memory: what sets the streaming tier's floor (a step takes at least the
bytes it streams over it). `plan` measures it from pinned memory where it finds a card and is not told
(--h2d-gbps); bench/h2d_bandwidth.py prints it pinned and pageable."""

import time


def measure_gbps(mib=512, repeats=3, pinned=True):
    """GB/s of one copy of ``mib`` MiB from host memory (pinned, or pageable) to the first card, the best of
    ``repeats``; None without a card."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = mib * 2**20
    source = torch.ones(n, dtype=torch.uint8)
    if pinned:
        source = source.pin_memory()
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
