#!/usr/bin/env bash
# Sets up .venv if needed, then runs the two-model training of examples/train_two_models.py under DeepSpeed
# ZeRO-2 + CPU optimizer offload on the CPU: first without the fix (it fails), then with ACCEL_DS_FIX=1.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup-venv.sh" || exit 1
cd "$ROOT"
ARGS=(examples/train_two_models.py --zero-stage 2 --offload cpu --steps 6)
LOG="$(mktemp)"

echo "== 1/2: without accel_ds_fix: accelerator.prepare(unet, text_encoder, optimizer, dataloader, scheduler)"
if python "${ARGS[@]}" >"$LOG" 2>&1; then
    echo "unexpected: the training ran without the fix"; exit 1
fi
grep -m1 -E "^(\[rank0\]: )?(AssertionError|KeyError)" "$LOG" | sed 's/^\[rank0\]: //'

echo "== 2/2: with ACCEL_DS_FIX=1 (the script itself is unchanged)"
if ! ACCEL_DS_FIX=1 python "${ARGS[@]}" 2>"$LOG"; then
    tail -30 "$LOG"; echo "FAILED: the training did not run with the fix"; exit 1
fi
grep "accel_ds_fix: merged" "$LOG" || true
echo "OK: fails without the fix, trains with it"
