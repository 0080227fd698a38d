"""The card's host-to-card copy bandwidth, pinned and pageable, in GB/s: what sets the streaming tier's floor
(a step cannot be shorter than the bytes it streams over this bandwidth). Prints one JSON line.

    python3 bench/h2d_bandwidth.py [--gib 2] [--repeats 5]
"""
import argparse
import json
import time

import torch


def measure(source, target, repeats):
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return source.numel() * source.element_size() / best / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = int(args.gib * 2**30)
    card = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = torch.ones(n, dtype=torch.uint8).pin_memory()
    pageable = torch.ones(n, dtype=torch.uint8)
    print(json.dumps({"gib": args.gib, "device": torch.cuda.get_device_name(0),
                      "pinned_gbps": round(measure(pinned, card, args.repeats), 1),
                      "pageable_gbps": round(measure(pageable, card, args.repeats), 1)}))


if __name__ == "__main__":
    main()
