#!/usr/bin/env bash
# diffusers' Flux DreamBooth scripts, unmodified, with --train_text_encoder on a Flux.1-dev-sized pipeline of random
# bf16 weights, 512 px, bf16, gradient checkpointing, batch 1: (z3) under the fix with a ZeRO-3 tier, the card
# capped, then (plain) the same script on the uncapped card with plain accelerate (no DeepSpeed, the fix off).
#   KIND=lora (issue 30 item 3a): train_dreambooth_lora_flux.py, LoRA rank 16, lr 1e-4, the whole of Flux.1-dev
#       (transformer 11.9B, CLIP-L, T5-XXL, VAE), configs/accelerate_zero3_offload.yaml, cap 16 GiB.
#   KIND=full (item 3b): train_dreambooth_flux.py, a full fine-tune of the transformer and CLIP-L, lr 1e-5, Flux.1-dev
#       widths with 4 double and 8 single blocks (transformer 2,556,184,640 parameters) and T5 at its width with 2
#       layers (517M; T5-XXL's 9.5 GB, which ZeRO-3 gathers whole onto the card, would not leave room in the cap),
#       the tier `plan` recommends for a 12 GiB card with 64 GiB of RAM (zero3-nvme: its config written by `plan
#       --write` with the swap folder $WORK/nvme), cap 12 GiB. Its plain run uses a copy of the script that puts the
#       frozen T5 on the card (the script leaves it on the CPU and encodes CLIP's ids there, which fails on a GPU
#       without DeepSpeed; under ZeRO-3 the fix gathers it onto the card). Frees $DROP (the LoRA job's pipeline)
#       where the disk has less than NEED_GB free.
#   KIND=sd35 / KIND=sdxl (issue 42's other figures): train_dreambooth_lora_sd3.py on an SD3.5-large-sized pipeline
#       (transformer 8.1B, CLIP-L and CLIP-G with projections, T5-XXL, VAE) in a 12 GiB cap, and
#       train_dreambooth_lora_sdxl.py on an SDXL-sized one (UNet 2.57B, CLIP-L, CLIP-G, VAE) in an 8 GiB cap; LoRA
#       rank 16 (the text encoders' LoRA too), lr 1e-4, 1024 px, zero2-stream. TINY=1: make_tiny_pipeline.py's
#       sd3 / sdxl at 64 px.
# A run in RUNS may carry tags after dots: st.prof (PROBE_PROFILE_STEP=$PROFILE_STEP, default 3: one step's chrome
# trace and bench/stream_profile.py's summary of it), st.pf2 (the streamer two blocks ahead), st.pfirst (the
# prepared models' blocks kept on the card before T5's and the VAE's, the order before keep_first), st.exp
# (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); its files are named with _ for the dots. Runs: z3, z3set,
# plain, st (zero2-stream in the cap), st0 / st100 (frozen_on_card_gib 0 / 100, in the cap), res (zero2-stream
# uncapped with nothing streamed: the tier's own cost beside plain's).
# Each run's report from bench/diffusers/script_probe.py (losses, step times, peak GPU allocated/reserved, host
# VmHWM and anonymous memory, at the end of training and for the whole process) goes to $RES/<P>NAME.json, its log
# to $RES/<P>NAME.log, a summary line to $RES/<P>summary.txt; `plan`'s prediction to $RES/<P>plan.txt (and .json);
# the prefix <P> is empty for KIND=lora and full_ for KIND=full, so that both jobs can share $RES.
#
#   here, once: bash bench/diffusers/flux_lora_gpu.sh prepare   # fills .ext/ (git-ignored): both Flux scripts of
#               # diffusers' tag v0.40.0 (the mirror's newest release; its check_min_version("0.40.0") passes with
#               # the carried 0.42.1) and peft 0.21.2 as files
#   there (device, carry .whl .cache/libaio .ext), both jobs in one:
#       export RES=/var/tmp/res
#       bash bench/gpu_detached.sh start 'bash bench/diffusers/flux_lora_gpu.sh; KIND=full bash bench/diffusers/flux_lora_gpu.sh'
#       WAIT_S=560 bash bench/gpu_detached.sh wait
#   CPU rehearsal (tiny shapes, 64 px, 2 steps, no cap, no installs; the zero3 run on DeepSpeed's CPU backend):
#       source /tmp/flux-run/env_main.sh; cd /work/main
#       TINY=1 RES=/tmp/flux_tiny/res WORK=/tmp/flux_tiny bash bench/diffusers/flux_lora_gpu.sh
#       KIND=full TINY=1 RES=/tmp/flux_tiny/res WORK=/tmp/fluxfull_tiny bash bench/diffusers/flux_lora_gpu.sh
#
# Settings (environment): KIND (lora | full), RUNS ("z3 plain"), STEPS (6), RESOLUTION (512), RANK (16, lora),
# LR (1e-4 | 1e-5), CAP (16 | 12, GiB; empty: none), TIER (the z3 run's: zero3-offload | zero3-nvme), SHAPE
# (make_shape_pipeline.py's options: "" | "--blocks 4,8 --t5-layers 2"), T_Z3 / T_PLAIN (timeout of each run, s:
# 540 / 300 | 420 / 180), WORK (/var/tmp/flux | /var/tmp/fluxfull: the pipeline, 33.6 | 6.6 GB, kept for a later
# job on the same machine), DROP / NEED_GB ("" | /var/tmp/flux, 50), PEFT (carried | machine | auto), SETUP (1:
# install the wheels unless installed, build cpu_adam and async_io), CKPT (1: one save_state at the last step; not
# for KIND=full, whose save hook rejects its CLIPTextModel), KEEP_OUT (1 | 0: keep each run's output folder),
# SCRIPT (the training script), SDPA (no-cudnn: cuDNN's attention off in both runs, as run 13 found its backward
# broken for Flux on torch 2.11+cu130 / cuDNN 9.19; empty: torch's default), ZERO_SET (JSON laid over the z3
# config's zero_optimization for a run named z3set in RUNS, e.g. RUNS="z3 z3set z3" to compare a tuning back to back).
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
EXT=$REPO/.ext
TAG=${DIFFUSERS_TAG:-v0.40.0}

if [ "${1:-}" = prepare ]; then  # here: the ignored kit folder
    set -e
    mkdir -p "$EXT/diffusers-$TAG"
    for name in train_dreambooth_lora_flux.py train_dreambooth_flux.py train_dreambooth_lora_sd3.py \
                train_dreambooth_lora_sdxl.py; do
        git --git-dir="${DIFFUSERS_GIT:-/work/.mirror/huggingface+diffusers/repo}" show \
            "$TAG:examples/dreambooth/$name" >"$EXT/diffusers-$TAG/$name"
    done
    read -r site version < <(python3 -c 'import os, peft; print(os.path.dirname(os.path.dirname(peft.__file__)), peft.__version__)')
    rm -f "$EXT"/peft-*.tar.gz
    tar -czf "$EXT/peft-$version.tar.gz" -C "$site" --exclude=__pycache__ peft "peft-$version.dist-info"
    git -C "$REPO" check-ignore -q "$EXT/x" || echo "WARNING: $EXT is not git-ignored: add it to .gitignore"
    ls -la "$EXT" "$EXT/diffusers-$TAG"; du -sh "$EXT"
    exit 0
fi

KIND=${KIND:-lora}
BASE=/var/tmp; [ "$(stat -f -c %T /var/tmp)" = tmpfs ] && BASE=/root  # pipelines and swap files on a disk, not RAM
RANK=${RANK:-16}
MAKE=flux-dev; TINY_KIND=flux; PIPELINE=FluxPipeline; RESOLUTION_DEFAULT=512
case $KIND in  # what differs: the script and its flags, the model's shape, the tier, the cap, the files' prefix
    lora) P=""; NAME=train_dreambooth_lora_flux.py; KIND_ARGS=(--rank "$RANK"); PLAN_KIND=(--lora-rank "$RANK")
          LR=${LR:-1e-4}; TIER=${TIER:-zero3-offload}; SHAPE=${SHAPE-}; CAP_GIB=16; T_Z3=${T_Z3:-540}
          T_PLAIN=${T_PLAIN:-300}; WORK=${WORK:-$BASE/flux}; DROP=${DROP-}; KEEP_OUT=${KEEP_OUT:-1} ;;
    full) P=full_; NAME=train_dreambooth_flux.py; KIND_ARGS=(); PLAN_KIND=()
          LR=${LR:-1e-5}; TIER=${TIER:-zero3-nvme}; SHAPE=${SHAPE---blocks 4,8 --t5-layers 2}; CAP_GIB=12
          T_Z3=${T_Z3:-420}; T_PLAIN=${T_PLAIN:-180}; WORK=${WORK:-$BASE/fluxfull}; DROP=${DROP-$BASE/flux}
          KEEP_OUT=${KEEP_OUT:-0} ;;
    sd35|sdxl)
          P=${KIND}_; KIND_ARGS=(--rank "$RANK"); PLAN_KIND=(--lora-rank "$RANK"); LR=${LR:-1e-4}
          TIER=${TIER:-zero2-stream}; SHAPE=${SHAPE-}; T_Z3=${T_Z3:-420}; T_PLAIN=${T_PLAIN:-240}
          WORK=${WORK:-$BASE/$KIND}; DROP=${DROP-}; KEEP_OUT=${KEEP_OUT:-1}; RESOLUTION_DEFAULT=1024
          if [ "$KIND" = sd35 ]; then
              NAME=train_dreambooth_lora_sd3.py; MAKE=sd35-large; TINY_KIND=sd3; PIPELINE=StableDiffusion3Pipeline
              CAP_GIB=12
          else
              NAME=train_dreambooth_lora_sdxl.py; MAKE=sdxl; TINY_KIND=sdxl; PIPELINE=StableDiffusionXLPipeline
              CAP_GIB=8
          fi ;;
    *) echo "KIND=$KIND: lora, full, sd35 or sdxl"; exit 2 ;;
esac
TINY=${TINY:-0}
if [ "$TINY" = 1 ]; then
    STEPS=${STEPS:-2}; RESOLUTION=${RESOLUTION:-64}; CAP=${CAP-}; SETUP=${SETUP:-0}; MAKE_ARGS="--tiny --device cpu"
else
    STEPS=${STEPS:-6}; RESOLUTION=${RESOLUTION:-$RESOLUTION_DEFAULT}; CAP=${CAP-$CAP_GIB}; SETUP=${SETUP:-1}; MAKE_ARGS=""
fi
RUNS=${RUNS:-z3 plain}; PEFT=${PEFT:-carried}; CKPT=${CKPT:-0}; NEED_GB=${NEED_GB:-50}
RES=${RES:-/var/tmp/res}
SCRIPT=${SCRIPT:-$EXT/diffusers-$TAG/$NAME}
M=$WORK/model
NVME=$WORK/nvme  # an NVMe tier's swap folder
mkdir -p "$RES" "$WORK"
cd "$REPO"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
note() { echo "$(date +%T) +${SECONDS}s $*" | tee -a "$RES/${P}summary.txt"; }
note "flux_lora_gpu: KIND=$KIND TINY=$TINY RUNS='$RUNS' STEPS=$STEPS RESOLUTION=$RESOLUTION TIER=$TIER CAP=${CAP:-none} SHAPE='$SHAPE' WORK=$WORK"
git -C "$REPO" log -1 --format='checkout: %h %s' 2>/dev/null | cut -c1-120 | tee -a "$RES/${P}summary.txt"
[ -f "$SCRIPT" ] || { note "ERROR: no $SCRIPT: run 'bash bench/diffusers/flux_lora_gpu.sh prepare' here and carry .ext"; exit 2; }

# --- setup: the wheels and this package (bench/gpu_env.sh), peft, versions, cpu_adam built in the background
if [ "$SETUP" = 1 ]; then
    note "setup: wheels"
    # shellcheck source=/dev/null
    source bench/gpu_env.sh || { note "ERROR: bench/gpu_env.sh failed (wheels in .whl? carried?)"; exit 2; }
fi
# peft: by default the carried one (0.21.2, the release the CPU rehearsals ran with: transformers 5.17 and 5.23,
# diffusers 0.40 and 0.42.1); PEFT=machine keeps the machine's own, PEFT=auto uses it where it is >= 0.17.0
machine_peft=$(python3 -c 'import peft; print("PEFT", peft.__version__)' 2>/dev/null | sed -n 's/^PEFT //p')
machine_peft=${machine_peft:-none}
peft_fits() {
    python3 -c 'import sys, peft; from packaging.version import Version; sys.exit(Version(peft.__version__) < Version("0.17.0"))' 2>/dev/null
}
if [ "$PEFT" = carried ] || { [ "$PEFT" = auto ] && ! peft_fits; }; then
    site=/tmp/flux_lora_site; rm -rf "$site"; mkdir -p "$site"
    tar -xzf "$(ls "$EXT"/peft-*.tar.gz | tail -1)" -C "$site" || { note "ERROR: no carried peft in $EXT"; exit 2; }
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    note "peft: the carried one ($(ls "$EXT"/peft-*.tar.gz | tail -1 | xargs basename)) on PYTHONPATH; the machine's: $machine_peft"
else
    note "peft: the machine's own ($machine_peft)"
fi
python3 - <<'EOF' 2>&1 | grep -v "Setting accelerator\|kernels-community\|gemm_4bit" | tee -a "$RES/${P}summary.txt"
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "transformers", "diffusers", "peft", "accelerate", "deepspeed", "torchvision", "huggingface_hub",
             "safetensors", "tokenizers", "accel_ds_fix"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '?')}  {module.__file__}")
    except Exception as e:
        print(f"  {name}: NOT IMPORTABLE: {e!r}")
import torch
print("  cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0), torch.version.cuda)
EOF
if ! PIPELINE=$PIPELINE python3 - >"$RES/${P}check.log" 2>&1 <<'EOF'
import os
from packaging.version import Version
import transformers
if Version(transformers.__version__) < Version("4.41.2"):
    raise SystemExit(f"transformers {transformers.__version__} is older than 4.41.2, which diffusers' Flux script needs")
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast  # noqa: F401
import diffusers
getattr(diffusers, os.environ["PIPELINE"])
from peft import LoraConfig  # noqa: F401
from torchvision import transforms  # noqa: F401
EOF
then
    note "ERROR: transformers / diffusers / peft / torchvision cannot run the Flux script here (transformers missing or too old for diffusers 0.42.1?):"
    tail -5 "$RES/${P}check.log" | tee -a "$RES/${P}summary.txt"; exit 2
fi
if [ "$SETUP" = 1 ]; then
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee -a "$RES/${P}summary.txt"
    free -g | tee -a "$RES/${P}summary.txt"; df -h "$WORK" | tee -a "$RES/${P}summary.txt"; nproc | tee -a "$RES/${P}summary.txt"
    # DeepSpeed's cpu_adam (the zero3 run's optimizer) and async_io (the NVMe tier's, built here too for a later
    # KIND=full job) compile while the pipeline is written (about 40 s; built by an earlier job: at once)
    ACCEL_DS_FIX=1 python3 -c "from accel_ds_fix.ops import builds; builds.build(('CPUAdamBuilder', 'AsyncIOBuilder'))" \
        >"$RES/${P}ops.log" 2>&1 &
    OPS=$!
fi

# --- the pipeline (kept on the machine for a later job), the images, the plan
if [ -e "$M/.complete" ]; then
    note "pipeline: reusing $M"
else
    free_gb=$(df -B1G --output=avail "$WORK" | tail -1 | tr -d ' ')
    if [ -n "$DROP" ] && [ "$free_gb" -lt "$NEED_GB" ] && [ -d "$DROP" ] && [ "$(realpath "$DROP")" != "$(realpath "$WORK")" ]; then
        note "disk: ${free_gb} GB free, under $NEED_GB: removing $DROP ($(du -sh "$DROP" | cut -f1))"
        rm -rf "$DROP"
    fi
    note "pipeline: writing $M"
    rm -rf "$M"
    # shellcheck disable=SC2086
    if [ "$TINY" = 1 ] && [ "$KIND" != lora ] && [ "$KIND" != full ]; then  # make_tiny_pipeline.py's SD3 / SDXL
        python3 bench/diffusers/make_tiny_pipeline.py "$TINY_KIND" "$WORK/tiny" --resolution 64 \
            >"$RES/${P}make_pipeline.log" 2>&1 && rm -rf "$M" && mv "$WORK/tiny/model" "$M"
    else
        python3 bench/diffusers/make_shape_pipeline.py "$MAKE" "$M" --random $MAKE_ARGS $SHAPE >"$RES/${P}make_pipeline.log" 2>&1
    fi && touch "$M/.complete" || { note "ERROR: making the pipeline failed"; tail -20 "$RES/${P}make_pipeline.log"; exit 2; }
    grep -v "Setting accelerator" "$RES/${P}make_pipeline.log" | tail -4 | tee -a "$RES/${P}summary.txt"
fi
du -sh "$M" | tee -a "$RES/${P}summary.txt"
python3 - "$WORK/instance" "$RESOLUTION" <<'EOF'
import os, sys
import numpy as np
from PIL import Image
out, size = sys.argv[1], int(sys.argv[2])
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(0)
y, x = np.mgrid[0:size, 0:size] / size
for i in range(4):  # smooth colour fields with some noise, as photos are neither flat nor white noise
    rgb = np.stack([np.sin(6.28 * (a * x + b * y) + c) for a, b, c in rng.uniform(0.5, 3, (3, 3))], -1)
    image = (127.5 + 100 * rgb + rng.normal(0, 10, rgb.shape)).clip(0, 255).astype(np.uint8)
    Image.fromarray(image).save(os.path.join(out, f"{i}.png"))
EOF
if [ -n "${OPS:-}" ]; then wait "$OPS"; note "ops build rc=$? ($(tail -2 "$RES/${P}ops.log" | tr '\n' ' '))"; fi
note "plan"
# the z3 run's config: the shipped pair, or for an NVMe tier the pair `plan --write` makes with $NVME as the swap
# folder (then the plan also measures that disk and predicts the time a step)
CONFIG=$REPO/configs/accelerate_${TIER//-/_}.yaml
PLAN=(python3 -m accel_ds_fix plan --model "$M" "${PLAN_KIND[@]}" --mixed-precision bf16 --gpu-memory "${CAP:-$CAP_GIB}GiB"
      --host-memory 64GiB)
case $TIER in *nvme*)
    rm -rf "$NVME" "$WORK/cfg"; mkdir -p "$NVME"
    PLAN+=(--nvme-path "$NVME" --steps "$STEPS" --tier "$TIER" --write "$WORK/cfg")
    CONFIG=$WORK/cfg/accelerate_${TIER//-/_}.yaml ;;
esac
"${PLAN[@]}" >"$RES/${P}plan.txt" 2>&1; "${PLAN[@]}" --json >"$RES/${P}plan.json" 2>"$RES/${P}plan_json.err"
if [ "$TINY" = 1 ] && [ "$CONFIG" = "$WORK/cfg/accelerate_${TIER//-/_}.yaml" ]; then
    # tiny: sub groups small enough that most are swapped and one is kept in RAM, as the full-size run's are
    python3 - "$WORK/cfg/ds_${TIER//-/_}.json" <<'EOF'
import json, sys
config = json.load(open(sys.argv[1]))
config["zero_optimization"]["sub_group_size"] = 50000
config["accel_ds_fix"]["nvme_optimizer_ram_gib"] = 0.001
json.dump(config, open(sys.argv[1], "w"), indent=2)
EOF
fi
grep -v "Setting accelerator\|heavy write traffic" "$RES/${P}plan.txt" | tee -a "$RES/${P}summary.txt"
python3 - "$RES/${P}plan.json" "$TIER" <<'EOF' 2>&1 | tee -a "$RES/${P}summary.txt"
import json, sys
plan, tier = json.load(open(sys.argv[1])), sys.argv[2]
row = next(t for t in plan["tiers"] if t["tier"] == tier)
timing = (plan.get("nvme_timing") or {}).get("per_accumulation") or [{}]
print(f"plan for the z3 run ({tier}; recommended: {plan['recommended']}"
      f"{'' if plan['recommended'] == tier else ', NOT the tier run here'}): GPU reserved {row['gpu_reserved_gib']} GiB, "
      f"host peak {row['host_gib']} GiB, NVMe {row['nvme_gib']} GiB, s/step {timing[0].get('seconds_per_step', '-')}"
      f" ({plan['trainable']:,} trained parameters)")
EOF
[ -f "$CONFIG" ] || { note "ERROR: no $CONFIG (plan --write failed? $RES/${P}plan.txt)"; exit 2; }
# the z3set run: the z3 run's config with ZERO_SET's keys laid over its zero_optimization (a tuning to compare)
if [ -n "${ZERO_SET:-}" ]; then
    CONFIG_SET=$WORK/cfg_set/$(basename "$CONFIG")
    python3 - "$CONFIG" "$CONFIG_SET" "$ZERO_SET" <<'EOF' || { note "ERROR: cannot lay ZERO_SET over $CONFIG"; exit 2; }
import json, os, re, sys
source, target, changes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
os.makedirs(os.path.dirname(target), exist_ok=True)
text = open(source).read()
name = re.search(r"deepspeed_config_file: *(\S+)", text).group(1)
ds_path = name if os.path.isabs(name) else os.path.join(os.path.dirname(source), name)
config = json.load(open(ds_path))
config["zero_optimization"].update(changes)
json.dump(config, open(os.path.join(os.path.dirname(target), "ds_set.json"), "w"), indent=2)
open(target, "w").write(text.replace(name, "ds_set.json"))
EOF
    note "z3set: $CONFIG_SET, zero_optimization + $ZERO_SET"
fi

# --- the runs
cat >"$WORK/plain.yaml" <<'EOF'
compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
mixed_precision: bf16
num_machines: 1
num_processes: 1
machine_rank: 0
use_cpu: false
dynamo_config: {}
EOF
# KIND=full's plain run: the script with its frozen T5 moved to the card, as the LoRA script moves it. Unchanged,
# the script leaves T5 on the CPU with --train_text_encoder, and encode_prompt takes T5's device for CLIP's ids and
# the embeddings: on a GPU without DeepSpeed, CLIP (on the card after prepare()) gets ids on the CPU. Under ZeRO-3
# the fix gathers the T5, loaded partitioned, onto the card, so the z3 run takes the script as it is.
SCRIPT_PLAIN=$SCRIPT
if [ "$KIND" = full ]; then
    SCRIPT_PLAIN=$WORK/${NAME%.py}_t5_on_card.py
    python3 - "$SCRIPT" "$SCRIPT_PLAIN" <<'EOF' || { note "ERROR: cannot place the T5 move in $SCRIPT"; exit 2; }
import sys
source, target = sys.argv[1:]
text = open(source).read()
anchor = """    if not args.train_text_encoder:
        text_encoder_one.to(accelerator.device, dtype=weight_dtype)
        text_encoder_two.to(accelerator.device, dtype=weight_dtype)
"""
assert text.count(anchor) == 1, "the anchor is not in the script once"
open(target, "w").write(text.replace(anchor, anchor + """    else:  # accel_ds_fix bench: the frozen T5 on the card
        text_encoder_two.to(accelerator.device, dtype=weight_dtype)
"""))
EOF
fi
# train NAME CONFIG ACCEL_DS_FIX CAP LIMIT SCRIPT [ENV...]: one launch of the script through the probe, then its
# summary line
train() {
    local name=$P$1 config=$2 fix=$3 cap=$4 limit=$5 script=$6 smi="" rc
    local out=$WORK/out_$1
    shift 6
    local tags=("$@")
    rm -rf "$out" "$RES/$name.json"
    local extra=(); [ "$CKPT" = 1 ] && extra=(--checkpointing_steps "$STEPS")
    if [ "$TINY" != 1 ] && command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 >"$RES/$name.smi.csv" 2>/dev/null &
        smi=$!
    fi
    note "run $name: $(basename "$script") $config, ACCEL_DS_FIX=$fix, cap ${cap:-none}, timeout ${limit}s"
    local t=$SECONDS
    (cd "$WORK" && env "${tags[@]}" ACCEL_DS_FIX="$fix" PROBE_OUT="$RES/$name.json" PROBE_CAP_GIB="$cap" PROBE_SDPA="${SDPA-no-cudnn}" \
        timeout -k 45 "$limit" python3 -m accelerate.commands.accelerate_cli launch --config_file "$config" \
        "$REPO/bench/diffusers/script_probe.py" "$script" \
        --pretrained_model_name_or_path "$M" --instance_data_dir "$WORK/instance" --instance_prompt "a photo of sks dog" \
        --output_dir "$out" --resolution "$RESOLUTION" --train_batch_size 1 --learning_rate "$LR" \
        --max_train_steps "$STEPS" --checkpointing_steps 100000 --mixed_precision bf16 --train_text_encoder \
        --gradient_checkpointing "${KIND_ARGS[@]}" --seed 0 "${extra[@]}") >"$RES/$name.log" 2>&1
    rc=$?
    [ -n "$smi" ] && kill "$smi" 2>/dev/null
    # a timed-out run: the DeepSpeed launcher starts the training process in a session of its own, which the
    # launcher's SIGKILL (timeout -k) leaves running; find it by its report path (our process only) and end it
    for proc in /proc/[0-9]*; do
        if { tr '\0' '\n' <"$proc/environ"; } 2>/dev/null | grep -qx "PROBE_OUT=$RES/$name.json"; then
            note "  ending the run's leftover process ${proc#/proc/}"; kill -9 "${proc#/proc/}" 2>/dev/null
        fi
    done
    note "run $name rc=$rc $((SECONDS - t))s$([ $rc = 124 ] && echo ' (timed out)')"
    if [ $rc != 0 ]; then
        grep -v "Setting accelerator\|kernels-community\|gemm_4bit" "$RES/$name.log" | tail -15
        # into the summary: the script's line the error passed (its last in the traceback) and the exception
        { grep -a "File \"$script\", line" "$RES/$name.log" | tail -1
          grep -a "^\(\[rank0\]: \)\?[A-Za-z_.]*\(Error\|Exception\): " "$RES/$name.log" |
              grep -v "ChildFailedError\|CalledProcessError" | tail -1; } | cut -c1-300 | tee -a "$RES/${P}summary.txt"
    fi
    python3 - "$RES/$name.json" "$out" "$RES/$name.smi.csv" "$M" <<'EOF' 2>&1 | tee -a "$RES/${P}summary.txt"
import glob, json, os, re, sys
path, out, smi, model = sys.argv[1:]
if not os.path.exists(path):
    sys.exit("  no probe report: the script stopped before its Accelerator was made")
r = json.load(open(path))
f = lambda x: "-" if x is None else f"{x:.2f}"
print(f"  losses {[round(x, 4) for x in r['losses']]}; s/step {[round(x, 2) for x in r['step_times']]}, "
      f"median after the first {f(r['median_step_s_after_first'])}; first backward at {f(r['first_backward_s'])} s")
print(f"  peaks, GiB (cap {r['cap_gib']}; host VmHWM reset per phase: {r['hwm_reset']}):")
if r.get("streaming"):
    print(f"  streaming: {r['streaming']}")
for name, p in r["peaks"].items():
    print(f"    {name:<9} GPU allocated {f(p.get('max_alloc'))} reserved {f(p.get('max_reserved'))}; "
          f"host VmHWM {f(p.get('hwm'))} RssAnon {f(p.get('anon_max'))}")
if os.path.exists(smi) and os.path.getsize(smi):
    used = [float(line.split(",")[1]) for line in open(smi) if line.count(",") == 1 and line.split(",")[1].strip().isdigit()]
    print(f"  nvidia-smi memory.used max {max(used) / 1024:.2f} GiB" if used else "  nvidia-smi: no samples")
lora = os.path.join(out, "pytorch_lora_weights.safetensors")
if os.path.exists(lora):
    from safetensors import safe_open
    counts = {}
    with safe_open(lora, "pt") as sf:
        for key in sf.keys():
            c = counts.setdefault(key.split(".")[0], [0, 0, 0])
            c[0] += 1
            if "lora_B" in key or key.endswith(".up.weight"):  # peft's names, or the SDXL script's older ones
                c[1] += 1
                c[2] += int(bool(sf.get_tensor(key).float().abs().sum() > 0))
    print("  export:", ", ".join(f"{k} {n} tensors, lora_B non-zero {z}/{b}" for k, (n, b, z) in counts.items()),
          f"({os.path.getsize(lora) / 2**20:.1f} MiB)")
elif os.path.exists(os.path.join(out, "model_index.json")):  # a full fine-tune's saved pipeline
    from safetensors import safe_open

    def plain_key(key):  # CLIPTextModel's keys with or without text_model. (transformers saves it under ZeRO-3)
        return re.sub(r"^(text_model\.)+", "", key)

    def files(folder):  # {tensor name: file}
        found = {}
        for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            with safe_open(file, "pt") as sf:
                found.update((plain_key(key), file) for key in sf.keys())
        return found

    def tensor(file, key):
        with safe_open(file, "pt") as sf:
            name = next(k for k in sf.keys() if plain_key(k) == key)
            return sf.get_tensor(name)

    parts = []  # the transformer: its first 64 tensors compared; T5 (frozen): only whether it was saved whole
    for part, most in (("transformer", 64), ("text_encoder", None), ("text_encoder_2", 0)):
        saved, start = files(os.path.join(out, part)), files(os.path.join(model, part))
        keys = sorted(set(saved) & set(start))
        empty = 0
        for key in keys:
            with safe_open(saved[key], "pt") as sf:
                empty += 0 in next(sf.get_slice(k) for k in sf.keys() if plain_key(k) == key).get_shape()
        keys = keys[:most]
        changed = sum(not tensor(saved[k], k).float().equal(tensor(start[k], k).float()) for k in keys)
        size = sum(os.path.getsize(f) for f in set(saved.values())) / 1e9
        dtype = str(tensor(saved[keys[0]], keys[0]).dtype).replace("torch.", "") if keys else ""
        parts.append(f"{part} {len(saved)} tensors ({len(start)} in the start; {size:.2f} GB {dtype})"
                     + (f", changed {changed}/{len(keys)}" if keys else "") + (f", EMPTY {empty}" if empty else ""))
    print("  export (the final save_pretrained):", "; ".join(parts))
else:
    print("  export: none")
EOF
    if [ -f "$RES/$name.json.trace.json.gz" ]; then  # a profiled step: where its time went
        python3 bench/stream_profile.py "$RES/$name.json.trace.json.gz" --json "$RES/$name.profile.json" 2>&1 |
            sed 's/^/  profile: /' | tee -a "$RES/${P}summary.txt"
        mv "$RES/$name.json.trace.json.gz" "$WORK/"  # large: kept on the machine, its summary comes back
    fi
    [ "$KEEP_OUT" = 1 ] || rm -rf "$out"
    case $config in "$WORK"/cfg/*) rm -rf "$NVME"; mkdir -p "$NVME" ;; esac  # the NVMe tier's swap files
    return $rc
}
# stream_config st0|st100: the shipped zero2-stream pair with frozen_on_card_gib 0 | 100, its yaml's path
stream_config() {
    python3 - "$REPO/configs" "$WORK/cfg_$1" "${1#st}" <<'EOF'
import json, os, sys
configs, target, on_card = sys.argv[1], sys.argv[2], float(sys.argv[3])
os.makedirs(target, exist_ok=True)
config = json.load(open(os.path.join(configs, "ds_zero2_stream.json")))
config["accel_ds_fix"]["frozen_on_card_gib"] = on_card
json.dump(config, open(os.path.join(target, "ds_zero2_stream.json"), "w"), indent=2)
text = open(os.path.join(configs, "accelerate_zero2_stream.yaml")).read()
open(os.path.join(target, "accelerate_zero2_stream.yaml"), "w").write(text)
print(os.path.join(target, "accelerate_zero2_stream.yaml"))
EOF
}
for run in $RUNS; do
    env=()
    for tag in $(echo "$run" | tr . ' ' | cut -d' ' -f2-); do
        [ "$tag" = "${run%%.*}" ] && continue
        case $tag in
            prof) env+=("PROBE_PROFILE_STEP=${PROFILE_STEP:-3}") ;;
            pf2) env+=("PROBE_STREAM_PREFETCH=2") ;;
            pfirst) env+=("PROBE_STREAM_ORDER=prepared") ;;
            exp) env+=("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True") ;;
            *) note "unknown tag $tag of $run" ;;
        esac
    done
    label=${run//./_}
    case ${run%%.*} in
        z3) train "$label" "$CONFIG" 1 "$CAP" "$T_Z3" "$SCRIPT" "${env[@]}" ;;
        z3set) train "$label" "${CONFIG_SET:?ZERO_SET is empty}" 1 "$CAP" "$T_Z3" "$SCRIPT" "${env[@]}" ;;
        st) train "$label" "$REPO/configs/accelerate_zero2_stream.yaml" 1 "$CAP" "$T_Z3" "$SCRIPT" "${env[@]}" ;;
        st0|st100)  # zero2-stream with frozen_on_card_gib 0 (every frozen block streams) or 100 (none does)
            train "$label" "$(stream_config "${run%%.*}")" 1 "$CAP" "$T_Z3" "$SCRIPT" "${env[@]}" ;;
        res)  # zero2-stream with nothing streamed on the uncapped card: the tier's own cost (ZeRO-2, the offloaded
              # optimizer) beside plain accelerate's, without a copy
            train "$label" "$(stream_config st100)" 1 "" "$T_Z3" "$SCRIPT" "${env[@]}" ;;
        plain) train "$label" "$WORK/plain.yaml" 0 "" "$T_PLAIN" "$SCRIPT_PLAIN" "${env[@]}" ;;
        *) note "unknown run $run" ;;
    esac
done
df -h "$WORK" | tail -1 | tee -a "$RES/${P}summary.txt"
note "flux_lora_gpu done"
