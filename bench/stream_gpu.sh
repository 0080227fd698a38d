#!/usr/bin/env bash
# The streaming tier on a GPU machine (docs/gpu.md, run 17), in the checkout with the kit carried (.whl .ext
# .cache/libaio), everything detached (bench/gpu_detached.sh: each call waits up to WAIT_S and brings back $RES):
#   1. the card's pinned and pageable copy bandwidth (bench/h2d_bandwidth.py);
#   2. diffusers' Flux LoRA (train_dreambooth_lora_flux.py of v0.40.0, unmodified, --train_text_encoder, r16) at
#      Flux.1-dev size, 512 px: zero2-stream in a 16 GiB cap, then plain accelerate uncapped, back to back
#      (bench/diffusers/flux_lora_gpu.sh, which writes the random pipeline first and builds cpu_adam beside it);
#   3. the small LoRA-shaped run of tests/stream_runs.py on the card, every frozen block streamed against none
#      (losses equal bit for bit; its frozen transformers T5, moved to the card before prepare(), is held and
#      streamed too), without gradient checkpointing, and resumed after a save;
#   4. the Flux LoRA at 1024 px, zero2-stream (16 GiB cap) and plain; 5. zero2-stream in a 12 GiB cap at 1024 px.
#   export RES=/var/tmp/res; bash bench/stream_gpu.sh start      # then: WAIT_S=560 bash bench/gpu_detached.sh wait
# STAGES (default "bw f512 small f1024 f1024c12") picks and orders them.
set -u
export RES=${RES:-/var/tmp/res}
if [ "${1:-}" = start ]; then
    exec bash bench/gpu_detached.sh start "bash bench/stream_gpu.sh job"
fi
source bench/gpu_env.sh || exit 2
flux() {  # flux NAME SETTINGS...: one flux_lora_gpu.sh job, its reports under $RES/NAME
    local name=$1; shift
    env RES="$RES/$name" TIER=zero2-stream "$@" bash bench/diffusers/flux_lora_gpu.sh
}
for stage in ${STAGES:-bw f512 small f1024 f1024c12}; do
    echo "=== $stage $(date +%T)"
    case $stage in
        bw) python3 bench/h2d_bandwidth.py | tee "$RES/bandwidth.json" ;;
        f512) flux f512 RUNS="st plain" STEPS=6 ;;
        f1024) flux f1024 RUNS="st plain" STEPS=4 RESOLUTION=1024 SETUP=0 T_PLAIN=240 ;;
        f1024c12) flux f1024c12 RUNS="st" STEPS=4 RESOLUTION=1024 SETUP=0 CAP=12 ;;
        small)
            for opts in '{"on_card": 0}' '{"on_card": 100}' '{"on_card": 0, "checkpointing": "none"}' \
                        '{"on_card": 0, "resume_at": 2}'; do
                python3 tests/stream_runs.py "$opts" >"$RES/small.out" 2>"$RES/small.err" || { tail -30 "$RES/small.err"; continue; }
                python3 - "$opts" "$RES/small.out" <<'PY' | tee -a "$RES/small.txt"
import json, sys
r = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
print(sys.argv[1], "losses", r["losses"], "counters", r["counters"], "frozen unchanged", r["frozen_unchanged"],
      "lora sum", repr(sum(abs(x) for v in r["lora"].values() for x in v)))
PY
                grep -h "streaming frozen\|held back" "$RES/small.err" | head -3 | tee -a "$RES/small.txt"
            done ;;
    esac
done
echo "=== done $(date +%T)"
