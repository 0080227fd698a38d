"""One fp16 convolution (forward + backward) on the GPU, after DeepSpeed's pin_memory op was loaded (which NVMe
offload loads with RTLD_GLOBAL), without or with accel_ds_fix; run each case in a fresh process:

    for c in plain pin_memory pin_memory_fixed; do python bench/pin_memory_cudnn.py $c; echo "$c: rc=$?"; done

On the H200 with DeepSpeed 0.19.8: plain ok, pin_memory SIGSEGV (rc 139) in cuDNN, pin_memory_fixed ok (docs/gpu.md).
"""

import faulthandler
import sys

import torch

faulthandler.enable()

case = sys.argv[1]
if case == "pin_memory_fixed":
    import accel_ds_fix  # noqa: F401
if case.startswith("pin_memory"):
    from deepspeed.ops.op_builder import PinMemoryBuilder
    PinMemoryBuilder().load()
conv = torch.nn.Conv2d(4, 320, 3, padding=1).cuda().half()
x = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.half, requires_grad=True)
conv(x).float().square().mean().backward()
torch.cuda.synchronize()
print("CONV OK", case, flush=True)
