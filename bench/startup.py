"""What ACCEL_DS_FIX=1 costs a Python process that never imports accelerate or DeepSpeed (users export the
variable in their shell profile, so every `python` pays it): `python -c pass` with the variable set and
unset, interleaved (A B A B ...), in this environment (the package and its .pth installed).

    python bench/startup.py            # 40 pairs
    python bench/startup.py --pairs 10

Prints each side's median start-up time, the median difference over the pairs with its min-max, and the
median ratio set/unset.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time


def start(env):
    begin = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - begin


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=40)
    args = p.parse_args()
    unset = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_DS_FIX")}
    on = {**unset, "ACCEL_DS_FIX": "1"}
    start(unset), start(on)  # warm the file cache
    pairs = [(start(unset), start(on)) for _ in range(args.pairs)]
    off_s, on_s = [a for a, _ in pairs], [b for _, b in pairs]
    diffs = [(b - a) * 1000 for a, b in pairs]
    ratios = [b / a for a, b in pairs]
    print(f"python -c pass, {args.pairs} interleaved pairs")
    print(f"  ACCEL_DS_FIX unset: median {statistics.median(off_s) * 1000:.1f} ms")
    print(f"  ACCEL_DS_FIX=1:     median {statistics.median(on_s) * 1000:.1f} ms")
    print(f"  cost of the variable: median {statistics.median(diffs):+.2f} ms (min {min(diffs):+.2f}, "
          f"max {max(diffs):+.2f})")
    print(f"  ratio set/unset: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
