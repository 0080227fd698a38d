"""Keep DeepSpeed's pin_memory op from standing in for libstdc++ in the libraries loaded after it.

DeepSpeed 0.19 loads its pin_memory op (which async_io, the NVMe offload, calls into) with RTLD_GLOBAL. The op
carries its own copies of C++ standard-library code (std::string members, stream inserters), and libstdc++
itself is not in the process's global symbol scope (Python and torch load it locally), so every library loaded
later binds those symbols to the op's copies. On the GPU, cuDNN's engine library, loaded at the first
convolution, then died in them (SIGSEGV in the UNet's first forward under the NVMe tier; docs/gpu.md). With the
process's own libstdc++ made global first, later libraries bind to it, as they would without the op.
"""

import ctypes
import os
import sys

LIBSTDCXX = "libstdc++.so.6"


def libstdcxx_first(wrapped, instance, args, kwargs):
    """PinMemoryBuilder.load: libstdc++ goes into the global scope before the op does."""
    make_libstdcxx_global()
    return wrapped(*args, **kwargs)


def make_libstdcxx_global():
    """Promote the libstdc++ this process already has to RTLD_GLOBAL; nothing when it has none (or not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(LIBSTDCXX, mode=os.RTLD_NOW | os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    except OSError:  # not loaded: no library can bind to it, and loading one here would change nothing
        return False
    return True
