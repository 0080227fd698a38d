"""DeepSpeed's op build asking for the CUDA architectures, as on a GPU machine, under TORCH_CUDA_ARCH_LIST from the
environment: prints what DeepSpeed read and set, and the variable afterwards. Stops before compiling anything.

    TORCH_CUDA_ARCH_LIST='9.0a' python tests/arch_list_probe.py [--fix]
"""

import os
import sys

if "--fix" in sys.argv:
    import accel_ds_fix  # noqa: F401

from deepspeed.ops.op_builder.async_io import AsyncIOBuilder  # the CUDA accelerator's builder of the NVMe op


class Probe(AsyncIOBuilder):
    def is_compatible(self, verbose=False):  # libaio or not: the architectures are what is probed here
        return True

    def nvcc_args(self):  # where a GPU build asks for the architectures
        self.compute_capability_args()
        print("DEEPSPEED SET", os.environ["TORCH_CUDA_ARCH_LIST"])
        raise KeyboardInterrupt  # stop before compiling


try:
    Probe().jit_load(verbose=False)
except KeyboardInterrupt:
    print("AFTER", os.environ["TORCH_CUDA_ARCH_LIST"])
