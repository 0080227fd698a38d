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
#   4. the Flux LoRA at 1024 px, zero2-stream (16 GiB cap) and plain; 5. zero2-stream in a 12 GiB cap at 1024 px;
#   sdxl, sd35: diffusers' SDXL LoRA (train_dreambooth_lora_sdxl.py) in an 8 GiB cap and SD3.5-large's
#      (train_dreambooth_lora_sd3.py) in a 12 GiB cap, 1024 px, --train_text_encoder, r16: zero2-stream, plain
#      uncapped, zero2-stream again (SDXL_RUNS, SD35_RUNS: tags as flux_lora_gpu.sh's, .prof a profiled step).
#   export RES=/var/tmp/res; bash bench/stream_gpu.sh start      # then: WAIT_S=560 bash bench/gpu_detached.sh wait
# STAGES (default "bw f512 small f1024 f1024c12") picks and orders them; the first stage that runs a script sets
# up the machine (SETUP=1), the others reuse it. A stage after sd35 that writes Flux frees the SD3.5 pipeline first.
set -u
export RES=${RES:-/var/tmp/res}
if [ "${1:-}" = start ]; then
    exec bash bench/gpu_detached.sh start "bash bench/stream_gpu.sh job"
fi
source bench/gpu_env.sh || exit 2
SET_UP=1  # the first script's job installs the wheels and builds DeepSpeed's ops; the later ones reuse them
flux() {  # flux NAME SETTINGS...: one flux_lora_gpu.sh job, its reports under $RES/NAME
    local name=$1; shift
    env RES="$RES/$name" TIER=zero2-stream SETUP=$SET_UP DROP="${DROP_FOR_FLUX-}" NEED_GB=40 "$@" \
        bash bench/diffusers/flux_lora_gpu.sh
    SET_UP=0
}
for stage in ${STAGES:-bw f512 small f1024 f1024c12}; do
    echo "=== $stage $(date +%T)"
    case $stage in
        bw) python3 bench/h2d_bandwidth.py | tee "$RES/bandwidth.json" ;;
        f512) flux f512 RUNS="${F512_RUNS:-st plain}" STEPS=6 ;;
        f1024) flux f1024 RUNS="${F1024_RUNS:-st plain}" STEPS=4 RESOLUTION=1024 T_PLAIN=240 ;;
        f1024c12) flux f1024c12 RUNS="${F1024C12_RUNS:-st}" STEPS=4 RESOLUTION=1024 CAP=12 ;;
        sdxl) flux sdxl KIND=sdxl RUNS="${SDXL_RUNS:-st plain st.prof}" STEPS=6 ;;
        sd35) flux sd35 KIND=sd35 RUNS="${SD35_RUNS:-st plain st.prof}" STEPS=6
              DROP_FOR_FLUX=$(ls -d /var/tmp/sd35 /root/sd35 2>/dev/null | head -1) ;;
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
