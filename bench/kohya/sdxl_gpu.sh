#!/bin/bash
# kohya's sdxl_train.py (48d368fa, unmodified) with --train_text_encoder --deepspeed: a full fine-tune of an SDXL-sized
# UNet with both text encoders (3.4B trained), issue 30 item 3b, beside the plan's prediction and the same script
# uncapped without DeepSpeed. Run from the checkout on a GPU machine (docs/gpu.md, "Next GPU run"), detached:
#   RES=/var/tmp/res bash bench/gpu_detached.sh start 'bash bench/kohya/sdxl_gpu.sh'
# Carry: .whl (DeepSpeed, accelerate, ... and .whl/kohya/: kohya's pins, transformers 4.54.1, diffusers 0.32.1,
# huggingface_hub 0.34.3, tokenizers 0.21.4, toml, voluptuous, imagesize, ftfy, wcwidth), .cache/libaio, .ext
# (.ext/sd-scripts: kohya's files). The pins go into their own folder ($SITE) ahead of the image's packages for the
# training runs only; the random pipeline is written with the image's diffusers.
# RUNS: zon (zero3-offload-nvme: the plan's tier for a 12 GB card with 64 GB of RAM), zo (zero3-offload), plain (no
# DeepSpeed, uncapped). CAP: the card's cap in GiB for the DeepSpeed runs (default 12).
# CPU rehearsal (the narrow SDXL of `make_shape_pipeline.py sdxl --random --tiny`, kohya's UNet narrowed alike):
#   SETUP=0 TINY=--tiny CAP= RESOLUTION=64 EXTRA_PATH=<cv2 and torchvision where missing> RES=/tmp/sdxl_res \
#   MODEL=/tmp/sdxl_tiny IN=/tmp/sdxl_in OUTD=/tmp/sdxl_out SITE=<kohya's pins installed> bash bench/kohya/sdxl_gpu.sh
set -u
REPO=$(pwd); KIT=$REPO/bench/kohya; K=${KOHYA:-$REPO/.ext/sd-scripts}
RES=${RES:-/var/tmp/res}; M=${MODEL:-/var/tmp/sdxl}; IN=${IN:-/var/tmp/sdxl_in}; OUTD=${OUTD:-/var/tmp/sdxl_out}
SITE=${SITE:-/tmp/kohyasite}; CAP=${CAP-12}; RESOLUTION=${RESOLUTION:-1024}; STEPS=${STEPS:-4}; TINY=${TINY:-}
SETUP=${SETUP:-1}; RUNS=${RUNS:-zon plain zo}; NVME=/var/tmp/accel_ds_fix_nvme
mkdir -p "$RES" "$OUTD"
exec >>"$RES/sdxl.log" 2>&1
note() { echo "$(date +%T) $*" | tee -a "$RES/summary.txt"; }

if [ "$SETUP" = 1 ]; then
    source bench/gpu_env.sh || note "gpu_env failed"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/kohya/*.whl || note "kohya's pins failed"
    t=$SECONDS; python3 -m accel_ds_fix build-ops >"$RES/ops.log" 2>&1; note "build-ops rc=$? $((SECONDS - t)) s"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$RES/summary.txt"
fi
# transformers 4.54 imports `kernels` where it is installed, and the image's kernels needs a newer huggingface_hub
# than the pins: a stand-in without its layers (transformers then goes without them, as where it is absent)
if python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('kernels') is None)"; then
    mkdir -p "$SITE/kernels"
    echo 'def get_kernel(*args, **kwargs): raise ImportError("kernels is hidden for kohya pins")' >"$SITE/kernels/__init__.py"
fi
PURELIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$KIT/kohya_val.py" "$PURELIB/" && echo "import kohya_val" >"$PURELIB/zz_kohya_val.pth"

if [ ! -e "$M/.complete" ]; then
    t=$SECONDS
    python3 bench/diffusers/make_shape_pipeline.py sdxl "$M" --random $TINY >"$RES/make_pipeline.log" 2>&1 &&
        touch "$M/.complete" || { note "ERROR: make_shape_pipeline failed"; tail -5 "$RES/make_pipeline.log"; exit 2; }
    note "pipeline written in $((SECONDS - t)) s: $(du -sh "$M" | cut -f1)"; cat "$RES/make_pipeline.log" >>"$RES/summary.txt"
fi
for name in openai_clip-vit-large-patch14 laion_CLIP-ViT-bigG-14-laion2B-39B-b160k; do  # kohya's tokenizer cache
    mkdir -p "$IN/tokenizer_cache" && cp -r "$M/tokenizer" "$IN/tokenizer_cache/$name"
done
python3 - "$IN/train_data/1_sks dog" "$RESOLUTION" <<'PY'
import os, sys
import numpy as np
from PIL import Image
folder, size = sys.argv[1], int(sys.argv[2])
os.makedirs(folder, exist_ok=True)
rng = np.random.default_rng(0)
for i in range(4):
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(os.path.join(folder, f"{i}.png"))
PY
python3 -m accel_ds_fix plan --model "$M" --gpu-memory 12GiB --host-memory 64GiB --mixed-precision bf16 \
    --nvme-path "$(dirname $NVME)" >"$RES/plan.txt" 2>&1; grep -A6 "^tier" "$RES/plan.txt" | tee -a "$RES/summary.txt"

LAUNCH="accelerate launch"; command -v accelerate >/dev/null || LAUNCH="python3 -m accelerate.commands.launch"
# run NAME CONFIG TIMEOUT: one launch, its log and report (losses, peaks, s/step), the saved checkpoint's check
run() {
    local name=$1 cfg=$2 limit=$3 cap=$CAP config ds=(--deepspeed)
    config=(--config_file "$REPO/configs/$cfg")
    if [ "$cfg" = none ]; then
        config=(--num_processes 1 --num_machines 1 --mixed_precision bf16 --dynamo_backend no); ds=(); cap=
    fi
    rm -rf "$NVME" "$OUTD/$name"
    local smi=
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$RES/$name.smi" 2>/dev/null & smi=$!
    fi
    local t=$SECONDS
    (cd "$IN" && env ACCEL_DS_FIX=1 PYTHONPATH="$SITE${EXTRA_PATH:+:$EXTRA_PATH}" KOHYA_VAL_OUT="$RES/$name.json" \
        KOHYA_VAL_CAP_GIB="$cap" KOHYA_VAL_SDPA=no-cudnn KOHYA_VAL_SDXL_CHANNELS=${TINY:+64} HF_HUB_OFFLINE=1 \
        timeout "$limit" $LAUNCH "${config[@]}" "$K/sdxl_train.py" --pretrained_model_name_or_path "$M" \
        --train_data_dir "$IN/train_data" --output_dir "$OUTD/$name" --resolution "$RESOLUTION" --train_batch_size 1 \
        --max_train_steps "$STEPS" --learning_rate 1e-5 --train_text_encoder --gradient_checkpointing --sdpa \
        --mixed_precision bf16 --save_precision bf16 --save_model_as safetensors \
        --tokenizer_cache_dir "$IN/tokenizer_cache" --seed 42 "${ds[@]}") >"$RES/$name.log" 2>&1
    local rc=$?
    [ -n "$smi" ] && kill "$smi" 2>/dev/null
    note "$name ($cfg, cap ${cap:-none}) rc=$rc $((SECONDS - t)) s"
    python3 - "$RES/$name.json" "$RES/$name.smi" "$OUTD/$name" <<'PY' | tee -a "$RES/summary.txt"
import glob, json, os, sys
try:
    r = json.load(open(sys.argv[1]))
    t = r["step_times"]
    steps = sorted(b - a for a, b in zip(t, t[1:]))
    print("  losses", [round(x, 4) for x in r["losses"]], "s/step after the first", [round(b - a, 2) for a, b in zip(t, t[1:])],
          "median %.2f" % steps[len(steps) // 2] if steps else "")
    print("  GPU allocated %.2f reserved %.2f GiB, host VmHWM %.2f GiB" % (r.get("peak_allocated_gib", 0),
          r.get("peak_reserved_gib", 0), r["peak_rss_gib"]))
except (OSError, ValueError, KeyError) as e:
    print("  no report:", e)
if os.path.exists(sys.argv[2]):
    used = [int(x) for x in open(sys.argv[2]).read().split() if x.isdigit()]
    print("  nvidia-smi max %.2f GiB" % (max(used) / 1024) if used else "  nvidia-smi: no samples")
files = glob.glob(os.path.join(sys.argv[3], "*.safetensors"))
if files:
    from safetensors import safe_open
    with safe_open(files[0], "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    empty = [k for k, s in shapes.items() if 0 in s]
    print(f"  saved {os.path.basename(files[0])}: {os.path.getsize(files[0]) / 1e9:.2f} GB, {len(shapes)} tensors, "
          f"{len(empty)} empty", empty[:3])
PY
    rm -rf "$OUTD/$name" "$NVME"
}

for r in $RUNS; do
    case $r in
        zon) run zon accelerate_zero3_offload_nvme.yaml "${T_ZON:-600}" ;;
        zo) run zo accelerate_zero3_offload.yaml "${T_ZO:-420}" ;;
        plain) run plain none "${T_PLAIN:-360}" ;;
    esac
done
note "done"
