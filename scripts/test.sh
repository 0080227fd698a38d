#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite on the real accelerate + DeepSpeed stack (CPU), in two
# workers (each test starts its own DeepSpeed processes; two at a time suit a 2-core machine).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup-venv.sh"
cd "$ROOT"
# DeepSpeed's ops compile once, here, where it shows (about 10 min on a fresh 2-core machine), not inside a test's
# time limit; later runs find them in .cache/torch_extensions.
python -m accel_ds_fix build-ops | grep --line-buffered -v "^\[20"
python -m pytest -n 2 "$@"
