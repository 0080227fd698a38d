#!/usr/bin/env bash
# Sets up .venv if needed, then runs the whole test suite on the real accelerate + DeepSpeed stack (CPU).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup-venv.sh"
cd "$ROOT"
python -m pytest "$@"
