#!/usr/bin/env bash
# docs/gpu.md run 8, on an H200 host (carry .whl and .cache/libaio): the NVMe tier's prerequisites as the fix
# sees them there, the disk's direct-I/O speed (dd and the plan's own measurement), the plan's predicted step, and
# the NVMe tier's SD1.5 step with the gradients in host memory against DeepSpeed's own swap, interleaved.
#   bash bench/nvme_gpu_run.sh 1    # ops, report, disk, plan, one round (host, disk)
#   bash bench/nvme_gpu_run.sh 2 [--deterministic --steps 2]    # another round (arguments go to nvme_step.py)
set -o pipefail
source bench/gpu_env.sh || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
{
    nproc; free -g | head -2; df -h "$NV" | tail -1; ldconfig -p | grep -c libaio || true
    if [ "$1" = 1 ]; then
        python3 -m accel_ds_fix build-ops 2>&1 | grep -v '^\[20'
        python3 -m accel_ds_fix 2>&1 | grep -A4 "shipped tiers"
        dd if=/dev/urandom of=/tmp/rand bs=8M count=128 status=none
        dd if=/tmp/rand of="$NV/dd" bs=8M count=128 oflag=direct 2>&1 | tail -1
        dd if="$NV/dd" of=/dev/null bs=8M iflag=direct 2>&1 | tail -1
        rm -f "$NV/dd" /tmp/rand
        python3 -m accel_ds_fix plan --params 983M --gpu-memory 6GiB --host-memory 15GiB --nvme-path "$NV" --steps 1600 \
            2>&1 | grep -v '^\[20'
    fi
    python3 bench/nvme_step.py --nvme-path "$NV" --rounds 1 --steps 4 --out "$OUT/nvme_step$1.json" "${@:2}"
    rm -rf "${NV:?}"/*  # the swap files (12 bytes a parameter) would crowd the disk of what runs next
} 2>&1 | tee "$OUT/log$1.txt"
