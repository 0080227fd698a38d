"""DeepSpeed's pin_memory op goes into the global symbol scope (NVMe offload): with the fix, libraries loaded
after it bind the C++ standard library to libstdc++, not to the op's copies (cuDNN crashed in them on the GPU)."""

import sys

import pytest

from conftest import clean_env, run

pytestmark = pytest.mark.quick  # no DeepSpeed engine: the quick loop runs it (scripts/test.sh --quick)

# Where would a library loaded now bind std::string::find(const char*, size_t, size_t)? Both the op and
# libstdc++ define it; dlsym(RTLD_DEFAULT) searches the global scope, as the dynamic linker does first.
PROBE = r"""
import ctypes, sys
if sys.argv[1] == "fix":
    import accel_ds_fix  # noqa: F401
from deepspeed.ops.op_builder.pin_memory import PinMemoryBuilder

PinMemoryBuilder().load()

class DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]

libc = ctypes.CDLL(None)
libc.dlsym.restype = ctypes.c_void_p
libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
address = libc.dlsym(None, b"_ZNKSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEE4findEPKcmm")
info = DlInfo()
libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info))
print("BOUND TO", info.fname.decode())
"""


def bound_to(mode):
    proc = run([sys.executable, "-c", PROBE, mode], env=clean_env(), timeout=900)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("BOUND TO"))
    return line.split("/")[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF symbol scopes")
def test_libraries_loaded_after_the_pin_memory_op_bind_to_libstdcxx():
    assert bound_to("plain") == "pin_memory.so"  # DeepSpeed alone: the op's copy stands in for libstdc++
    assert bound_to("fix").startswith("libstdc++.so.6")
