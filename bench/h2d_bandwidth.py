"""The card's host-to-card copy bandwidth, pinned and pageable, in GB/s: what sets the streaming tier's floor
(a step cannot be shorter than the bytes it streams over this bandwidth). Prints one JSON line; the measurement
is the package's own (accel_ds_fix/streaming/copy_speed.py, which `plan` runs with 512 MiB).

    python3 bench/h2d_bandwidth.py [--gib 2] [--repeats 5]
"""
import argparse
import json

import torch

from accel_ds_fix.streaming.copy_speed import measure_gbps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    mib = int(args.gib * 1024)
    print(json.dumps({"gib": args.gib, "device": torch.cuda.get_device_name(0),
                      "pinned_gbps": round(measure_gbps(mib, args.repeats, pinned=True), 1),
                      "pageable_gbps": round(measure_gbps(mib, args.repeats, pinned=False), 1)}))


if __name__ == "__main__":
    main()
