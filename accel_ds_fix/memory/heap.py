"""Host memory a load has freed goes back to the system.

glibc keeps memory that Python and torch free in its heap for later allocations (only blocks over its mmap
threshold, at most 32 MiB, go back at once). A checkpoint load allocates and frees gigabytes in smaller pieces, so
the resident memory of a resumed run stayed about that much above an uninterrupted one for the whole run: SD1.5
under zero3-nvme on the CPU, 9.68 GiB right after load_state, 7.82 after malloc_trim(0), and the resumed training's
peak 10.06 GiB without it against 9.55 with it (bench/resume_peak.py --model sd15 --full-size). malloc_trim gives
the free top and free pages back; nothing in use moves.
"""

import ctypes
import ctypes.util


def return_freed_memory():
    """malloc_trim(0) where the C library is glibc; True where it ran."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
