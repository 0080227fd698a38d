#!/usr/bin/env bash
# Creates .venv (once) with the package, its test extras and the pinned stack of constraints.txt.
# Sourced by demo.sh and test.sh; everything it caches stays inside the checkout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
export TORCH_EXTENSIONS_DIR="$ROOT/.cache/torch_extensions"  # DeepSpeed's JIT-built CPU ops
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -f "$VENV/.installed" ] || [ "$ROOT/setup.cfg" -nt "$VENV/.installed" ] || [ "$ROOT/constraints.txt" -nt "$VENV/.installed" ]; then
    echo "setting up $VENV (log: .cache/setup.log)"
    mkdir -p "$ROOT/.cache"
    {
        python3 -m venv "$VENV" &&
        "$VENV/bin/pip" install -q --upgrade pip &&
        # torch first, alone: pip then takes the local CPU build instead of resolving a CUDA one for deepspeed.
        "$VENV/bin/pip" install -q -c "$ROOT/constraints.txt" torch &&
        "$VENV/bin/pip" install -q -c "$ROOT/constraints.txt" -e "$ROOT[test]"
    } >"$ROOT/.cache/setup.log" 2>&1 || { tail -40 "$ROOT/.cache/setup.log"; echo "set-up failed"; exit 1; }
    touch "$VENV/.installed"
fi
export PATH="$VENV/bin:$PATH"
# The NVMe tier's async_io op needs libaio. Where the system lacks it, Debian's packages are unpacked into the
# checkout (no root needed) and the fix puts them on the build and load paths; where that cannot be done, the
# line says why and the NVMe tests are skipped, each with that reason.
export ACCEL_DS_FIX_LIBAIO="$ROOT/.cache/libaio"
python -m accel_ds_fix get-libaio "$ACCEL_DS_FIX_LIBAIO" | grep -v "need ACCEL_DS_FIX_LIBAIO" || true
