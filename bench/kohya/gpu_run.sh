#!/bin/bash
# kohya's train_db.py (newest 48d368fa, January 2023 bf691aef) under the shipped tiers and its train_network.py (LoRA),
# unmodified, the card capped at 6 GiB: docs/gpu.md, run 7. Run from the checkout on an H200 host, detached
# (setsid); logs and reports in $L, $L/done at the end. Needs (docs/gpu.md lists them): .whl/ (DeepSpeed and
# kohya's pins as wheels), .debs/ (libaio), .kohya/newest and .kohya/jan2023 (`git archive` of the two commits:
# train_db.py, train_network.py, library/, networks/), .kohya/jan2023whl/ (the January 2023 scripts' diffusers, transformers...).
# CPU rehearsal (EXTRA_PATH: a torchvision stand-in where none loads; UNET_CHANNELS: kohya's UNet narrowed, see
# kohya_val.py, since SD1.5's width does not fit a small machine's RAM under zero2-offload): EXTRA_PATH=/tmp/tvstub
#   MP=bf16 RESOLUTION=64 TINY=--tiny UNET_CHANNELS=32,64,64,64 CAP= SETUP=0 IN=/tmp/insmall L=/tmp/kvcpu
#   OUTD=/tmp/kvcpu_out RUNS="ZA ZS ZR" STEPS=4 bash bench/kohya/gpu_run.sh
set -u
REPO=$(pwd); K=$REPO/.kohya; KIT=$REPO/bench/kohya
L=${L:-/tmp/kv}; IN=${IN:-/tmp/in}; OUTD=${OUTD:-/var/tmp/out}
MP=${MP:-fp16}; RESOLUTION=${RESOLUTION:-512}; TINY=${TINY:-}; UNET_CHANNELS=${UNET_CHANNELS:-}; CAP=${CAP-6}; SETUP=${SETUP:-1}; RUNS=${RUNS:-A R S3N Z B S3O}; STEPS=${STEPS:-4}
mkdir -p "$L" "$OUTD"; rm -f "$L/done"
exec >>"$L/main.log" 2>&1
export PYTHONUNBUFFERED=1 USE_FLAX=0 TORCH_CUDA_ARCH_LIST=9.0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
note() { echo "$(date +%T) $*" | tee -a "$L/summary.txt"; }

if [ "$SETUP" = 1 ]; then
    export TORCH_EXTENSIONS_DIR=/tmp/ext
    if [ -d .cache/libaio ]; then  # `python -m accel_ds_fix get-libaio .cache/libaio`: the fix sets the paths
        export ACCEL_DS_FIX_LIBAIO="$REPO/.cache/libaio"
    else
        mkdir -p /tmp/aio && for f in .debs/*.deb; do dpkg -x "$f" /tmp/aio; done
        export CPATH=/tmp/aio/usr/include LIBRARY_PATH=/tmp/aio/usr/lib/x86_64-linux-gnu LD_LIBRARY_PATH=/tmp/aio/usr/lib/x86_64-linux-gnu
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade .whl/*.whl || note "wheels failed"
    python3 -m pip install -q --no-index --no-deps --no-build-isolation . || note "package install failed"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/jan2023site "$K"/jan2023whl/*.whl || note "January 2023 wheels failed"
    SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cp "$KIT/kohya_val.py" "$SITE/" && echo "import kohya_val" >"$SITE/zz_kohya_val.pth"
    note "setup done: $(python3 -c 'import torch, accelerate, deepspeed, transformers, diffusers; print(torch.__version__, accelerate.__version__, deepspeed.__version__, transformers.__version__, diffusers.__version__)')"
    df -h /var/tmp /tmp | tee -a "$L/summary.txt"; stat -f -c 'var/tmp fs %T' /var/tmp | tee -a "$L/summary.txt"
    t=$(date +%s); python3 -m accel_ds_fix build-ops >"$L/ops.log" 2>&1; note "build-ops rc=$? $(( $(date +%s) - t ))s"
fi
[ -d "$IN/model" ] || { t=$(date +%s); python3 "$KIT/make_inputs.py" "$IN" $TINY ${UNET_CHANNELS:+--unet-channels "$UNET_CHANNELS"} --resolution "$RESOLUTION" >"$L/inputs.log" 2>&1; note "inputs rc=$? $(( $(date +%s) - t ))s"; }

LAUNCH="accelerate launch"; command -v accelerate >/dev/null || LAUNCH="python3 -m accelerate.commands.launch"
# kohya NAME YAML newest|jan2023 TIMEOUT ARGS...: one launch, its log, report (losses, peaks) and wall time
kohya() {
    local name=$1 yaml=$2 which=$3 limit=$4; shift 4
    local extra=() envs=(ACCEL_DS_FIX=1 KOHYA_VAL_OUT="$L/$name.json" KOHYA_VAL_CAP_GIB="$CAP" KOHYA_VAL_UNET_CHANNELS="$UNET_CHANNELS")
    if [ "$which" = jan2023 ]; then envs+=(PYTHONPATH=/tmp/jan2023site${EXTRA_PATH:+:$EXTRA_PATH} KOHYA_VAL_JAN2023_SHIM=1)
    else extra=(--tokenizer_cache_dir "$IN/tokenizer_cache"); [ -n "${EXTRA_PATH:-}" ] && envs+=(PYTHONPATH="$EXTRA_PATH"); fi
    rm -rf /var/tmp/accel_ds_fix_nvme
    local t=$(date +%s)
    local script=${SCRIPT:-train_db.py} config=(--config_file "$REPO/configs/$yaml")
    [ "$yaml" = none ] && config=(--num_processes 1 --num_machines 1 --mixed_precision "$MP" --dynamo_backend no)
    (cd "$IN" && env "${envs[@]}" timeout "$limit" $LAUNCH "${config[@]}" "$K/$which/$script" \
        --pretrained_model_name_or_path "$IN/model" --train_data_dir "$IN/train_data" --output_dir "$OUTD/$name" \
        --mixed_precision "$MP" --gradient_checkpointing --learning_rate 1e-6 --train_batch_size 1 --resolution "$RESOLUTION" \
        --seed 42 --save_model_as ${SAVE_AS:-diffusers_safetensors} "${extra[@]}" "$@") >"$L/$name.log" 2>&1
    local rc=$?
    note "$name ($which, $yaml) rc=$rc $(( $(date +%s) - t ))s; out: $(ls "$OUTD/$name" 2>/dev/null | tr '\n' ' ')"
    [ -e "$L/$name.json" ] && python3 -c "import json; r = json.load(open('$L/$name.json')); t = r['step_times']; \
print('  losses', [round(x, 6) for x in r['losses']], 'peak alloc %.2f reserved %.2f GiB, host %.2f GiB' % (r.get('peak_allocated_gib', 0), r.get('peak_reserved_gib', 0), r['peak_rss_gib']), \
's/step (after the first)', [round(b - a, 2) for a, b in zip(t, t[1:])])" | tee -a "$L/summary.txt"
    [ -d "$OUTD/$name/last" ] && CMP_DTYPE=$MP python3 "$KIT/compare.py" "$IN/model" "$OUTD/$name/last" ${COMPARE_WITH:+"$COMPARE_WITH"} | tee -a "$L/summary.txt"
    du -sh "$OUTD/$name" 2>/dev/null | tee -a "$L/summary.txt"
    return $rc
}

# the state a run NAME saved after its first epoch (empty if none): what R, ZS and ZR resume
epoch1_state() { ls -d "$OUTD/$1"/*000001-state 2>/dev/null | head -1; }

for run in $RUNS; do
    case $run in
        A)   kohya A accelerate_zero3_nvme.yaml newest 900 --max_train_steps $STEPS --save_state --save_every_n_epochs 1 \
                 --save_last_n_epochs 1 --save_last_n_epochs_state 1
             rm -rf "$OUTD/A/last-state" ;;
        R)   st=$(epoch1_state A)
             [ -n "$st" ] && COMPARE_WITH="$OUTD/A/last" kohya R accelerate_zero3_nvme.yaml newest 600 --resume "$st" --max_train_steps $((STEPS - 2))
             rm -rf "$OUTD/A"/*-state ;;
        # issue 20: a state saved under zero2-offload resumed under zero3-nvme (the move when RAM is short): the
        # resume converts it (one "converted it to DeepSpeed's universal checkpoint format in N s" line in ZR.log)
        ZA)  kohya ZA accelerate_zero2_offload.yaml newest 600 --max_train_steps $STEPS --save_state --save_every_n_epochs 1 \
                 --save_last_n_epochs 1 --save_last_n_epochs_state 1
             rm -rf "$OUTD/ZA/last-state" ;;
        # the same state resumed in its own layout: what ZR's losses are compared with (kohya's resume alone)
        ZS)  st=$(epoch1_state ZA)
             [ -n "$st" ] && COMPARE_WITH="$OUTD/ZA/last" kohya ZS accelerate_zero2_offload.yaml newest 600 --resume "$st" --max_train_steps $((STEPS - 2)) ;;
        ZR)  st=$(epoch1_state ZA)
             [ -n "$st" ] && COMPARE_WITH="$OUTD/ZA/last" kohya ZR accelerate_zero3_nvme.yaml newest 900 --resume "$st" --max_train_steps $((STEPS - 2))
             [ -n "$st" ] && du -sh "$(dirname "$st")"/.accel_ds_fix-universal.* | tee -a "$L/summary.txt"
             grep -h "universal checkpoint format\|universal copy" "$L/ZR.log" | tee -a "$L/summary.txt"
             rm -rf "$OUTD/ZA"/*-state "$OUTD/ZA"/.accel_ds_fix-universal.* ;;
        A2)  kohya A2 accelerate_zero3_nvme.yaml newest 600 --max_train_steps $STEPS ;;  # A again, no saves: run-to-run spread
        B)   kohya B accelerate_zero3_offload.yaml newest 500 --max_train_steps $STEPS ;;
        Z)   kohya Z accelerate_zero2_offload.yaml newest 400 --max_train_steps $STEPS ;;
        S3N) kohya S3N accelerate_zero3_nvme.yaml jan2023 700 --max_train_steps $STEPS ;;
        S3O) kohya S3O accelerate_zero3_offload.yaml jan2023 500 --max_train_steps $STEPS ;;
        S2O) kohya S2O accelerate_zero2_offload.yaml jan2023 400 --max_train_steps $STEPS ;;
        # the low-memory alternative: LoRA rank 8 on UNet + text encoder, plain accelerate (no DeepSpeed)
        L)   SCRIPT=train_network.py SAVE_AS=safetensors kohya L none newest 400 --max_train_steps $((STEPS * 2)) --network_module networks.lora \
                 --network_dim 8 --network_alpha 8 --learning_rate 1e-4 ;;
    esac
done
note "all done"; touch "$L/done"
