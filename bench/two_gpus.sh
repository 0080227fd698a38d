#!/usr/bin/env bash
# Several processes (issue: data-parallel ZeRO-2/3 over NCCL, the nvidia-h200-x2 machine kind), from the checkout:
#   bash bench/two_gpus.sh OUT_DIR [NUM_PROCESSES]
# For ZeRO-2, ZeRO-3 and ZeRO-2 + CPU optimizer offload, `accelerate launch --num_processes N` runs the two-model
# example through the fix (ACCEL_DS_FIX=1) and through a hand-written merged module: the losses must be equal,
# and differ from a one-process run (N data shards). Then save_state after 3 steps, load_state in new processes:
# the 3 resumed losses must equal the uninterrupted run's; and under ZeRO-3 every process exports full tensors.
# On a CPU-only machine the same runs use gloo (a dry run of this script). NVLink multicast stays off.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bench/two_gpus.sh OUT_DIR [NUM_PROCESSES]}
N=${2:-2}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
status=0
launch() {  # launch PROCESSES STAGE OFFLOAD ARGS...
    local n=$1 stage=$2 offload=$3; shift 3
    python3 -m accelerate.commands.launch --use_deepspeed --num_processes "$n" --num_machines 1 \
        --zero_stage "$stage" --offload_optimizer_device "$offload" --offload_param_device none \
        --mixed_precision no --gradient_accumulation_steps 1 examples/train_two_models.py "$@"
}
check() {  # check NAME PYTHON_EXPRESSION_OVER_JSON_FILES
    if python3 - "$OUT" "$2" <<'PY'
import json, os, sys
out, expr = sys.argv[1], sys.argv[2]
r = {f[:-5]: json.load(open(os.path.join(out, f))) for f in os.listdir(out) if f.endswith(".json")}
sys.exit(0 if eval(expr) else 1)
PY
    then echo "PASS $1"; else echo "FAIL $1"; status=1; fi
}
for case in "2 none zero2" "3 none zero3" "2 cpu zero2-offload"; do
    set -- $case; stage=$1; offload=$2; name=$3
    ACCEL_DS_FIX=1 launch "$N" "$stage" "$offload" --steps 6 --out "$OUT/$name-fix.json" >"$OUT/$name-fix.log" 2>&1
    launch "$N" "$stage" "$offload" --reference --steps 6 --out "$OUT/$name-hand.json" >"$OUT/$name-hand.log" 2>&1
    ACCEL_DS_FIX=1 launch 1 "$stage" "$offload" --steps 6 --out "$OUT/$name-one.json" >"$OUT/$name-one.log" 2>&1
    check "$name: fix == hand-written merge on $N processes" "r['$name-fix']['losses'] == r['$name-hand']['losses']"
    check "$name: $N processes != 1 process" "r['$name-fix']['losses'] != r['$name-one']['losses']"
    ACCEL_DS_FIX=1 launch "$N" "$stage" "$offload" --steps 6 --save-state "$OUT/$name-ckpt" --save-state-at 3 \
        --out "$OUT/$name-first.json" >"$OUT/$name-first.log" 2>&1
    ACCEL_DS_FIX=1 launch "$N" "$stage" "$offload" --steps 3 --first-step 3 --resume "$OUT/$name-ckpt" \
        --out "$OUT/$name-resumed.json" >"$OUT/$name-resumed.log" 2>&1
    check "$name: resumed on $N processes == uninterrupted" \
        "r['$name-resumed']['losses'] == r['$name-first']['losses'][3:]"
done
ACCEL_DS_FIX=1 launch "$N" 3 none --steps 6 --export "$OUT/zero3-export" --out "$OUT/zero3-export.json" \
    >"$OUT/zero3-export.log" 2>&1
python3 - "$OUT/zero3-export" <<'PY' && echo "PASS zero3: exports of every process call are full tensors" || { echo "FAIL zero3 exports"; status=1; }
import glob, sys, torch
files = glob.glob(sys.argv[1] + "/*.pt")
assert len(files) == 4, files
for f in files:
    assert all(t.numel() > 0 for t in torch.load(f, weights_only=True).values()), f
PY
exit $status
