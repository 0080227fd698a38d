# Source on the GPU machine (no network) in the checkout, with the wheels in .whl/ and libaio (below) carried
# along (docs/gpu.md lists them): installs DeepSpeed 0.19.8, accelerate 1.16.0, diffusers and this package into the machine's Python, and points DeepSpeed's op builds at libaio (the
# async_io op of the NVMe tier). Sets NV to a folder on a disk (not a tmpfs) for NVMe offload.
export PYTHONUNBUFFERED=1 USE_FLAX=0 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ext
# libaio: the folder `python -m accel_ds_fix get-libaio .cache/libaio` made here (carry .cache/libaio), which the
# fix puts on the op build's and loader's paths itself; or Debian's .debs in .debs/ (older kits)
if [ -d .cache/libaio ]; then
    export ACCEL_DS_FIX_LIBAIO="$PWD/.cache/libaio"
else
    mkdir -p /tmp/aio && for f in .debs/*.deb; do dpkg -x "$f" /tmp/aio; done
    export CPATH=/tmp/aio/usr/include LIBRARY_PATH=/tmp/aio/usr/lib/x86_64-linux-gnu LD_LIBRARY_PATH=/tmp/aio/usr/lib/x86_64-linux-gnu
fi
python3 -m pip show -q deepspeed accel_ds_fix >/dev/null 2>&1 || {
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade .whl/*.whl &&
    python3 -m pip install -q --no-index --no-deps --no-build-isolation .
} || return 1
NV=/var/tmp/nvme
[ "$(stat -f -c %T /var/tmp)" = tmpfs ] && NV=/root/nvme
mkdir -p "$NV"
