"""The benches' way of measuring variants: each in its own process (a fresh CUDA context and allocator, its own peak
host memory), the script itself called again with --worker NAME, writing its result as JSON."""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def run_each(script, names, out, flags, env_for=lambda name: {}):
    """Yield each variant's result dict, in order: what its worker wrote to OUT.NAME.json, or its status
    "failed (rc)" and the end of its stderr. ``flags``: the arguments every worker gets besides --worker/--out."""
    for name in names:
        path = Path(out).with_suffix(f".{name}.json")
        started = time.time()
        proc = subprocess.run([sys.executable, script, "--worker", name, "--out", str(path), *flags],
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **env_for(name)})
        if proc.returncode != 0 or not path.exists():
            result = {"variant": name, "status": f"failed ({proc.returncode})", "log": proc.stderr[-3000:]}
            print(proc.stderr[-3000:], file=sys.stderr)
        else:
            result = json.loads(path.read_text())
        result["wall_s"] = time.time() - started
        yield result


def add_arguments(parser, cap_gib, out):
    """What every variant bench takes besides its own: the card's cap, the NVMe folder, the CPU smoke test, the
    results file, and the hidden --worker its processes are started with."""
    parser.add_argument("--cap-gib", type=float, default=cap_gib)
    parser.add_argument("--nvme-path", default="/var/tmp/accel_ds_fix_nvme")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: a smoke test of the script")
    parser.add_argument("--out", default=out)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
