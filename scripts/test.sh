#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite on the real accelerate + DeepSpeed stack (CPU), in two
# workers (each test starts its own DeepSpeed processes; two at a time suit a 2-core machine).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup-venv.sh"
cd "$ROOT"
python -m pytest -n 2 "$@"
