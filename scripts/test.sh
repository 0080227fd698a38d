#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite on the real accelerate + DeepSpeed stack (CPU), in two
# workers (each test starts its own DeepSpeed processes; two at a time suit a 2-core machine).
#   ./scripts/test.sh            every test (CI runs this)
#   ./scripts/test.sh --quick    the tests marked quick: no DeepSpeed engine, about a minute
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup-venv.sh"
cd "$ROOT"
if [ "${1:-}" = --quick ]; then
    # The loop for a change (about a minute): the plan, the memory model, install and packaging, the pages; no
    # DeepSpeed engine is built. Run the whole suite (no --quick) before a commit that touches training.
    shift
    python -m pytest -n 2 -m quick "$@"
    echo "quick loop only: ./scripts/test.sh runs every test (DeepSpeed on the CPU), as CI does"
    exit
fi
# DeepSpeed's ops compile once, here, where it shows (about 10 min on a fresh 2-core machine), not inside a test's
# time limit; later runs find them in .cache/torch_extensions.
python -m accel_ds_fix build-ops | grep --line-buffered -v "^\[20"
python -m pytest -n 2 "$@"
