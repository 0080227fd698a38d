"""py-cpuinfo's get_cpu_info() asked once a machine, not three times a launch.

It starts a Python subprocess each call (about 1.2 s on a 2-core machine), and DeepSpeed calls it three times
while loading its CPU ops (the compiler flags, the SIMD width, the CPU vendor): 3.5 s of every launch with
optimizer offload, for an answer that does not change. The first answer is kept for the process, and in a file
beside DeepSpeed's built ops (TORCH_EXTENSIONS_DIR, else torch's default folder for them), named after what
/proc/cpuinfo says of the CPU (its model and feature flags) and py-cpuinfo's release: another CPU, on a cluster
that shares a home folder, finds no file of its own and asks py-cpuinfo.
"""

import copy
import hashlib
import json
import os
import sys
import tempfile

_answer = None


def once(wrapped, instance, args, kwargs):
    global _answer
    if _answer is None:
        path = _cache_path()
        _answer = _read(path)
        if _answer is None:
            _answer = wrapped(*args, **kwargs)
            _write(path, _answer)
    return copy.deepcopy(_answer)  # callers get their own dict, as from each call before


def _cache_path():
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            described = sorted({line.strip() for line in f if line.startswith(("model name", "flags", "vendor_id"))})
    except OSError:
        return None  # not Linux: nothing to key the answer on
    version = getattr(sys.modules.get("cpuinfo"), "CPUINFO_VERSION_STRING", "")
    key = hashlib.sha1("\n".join([version, *described]).encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    return os.path.join(root, f"accel_ds_fix-cpuinfo-{key}.json")


def _read(path):
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            answer = json.load(f)
        return answer if isinstance(answer, dict) and answer.get("flags") is not None else None
    except (OSError, ValueError):
        return None


def _write(path, answer):
    if path is None:
        return
    temporary = None
    try:  # a whole file or none: written aside, then renamed
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".cpuinfo-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(answer, f)
        os.replace(temporary, path)
    except (OSError, TypeError, ValueError):  # a read-only home: asked again next launch, as without the file
        if temporary and os.path.exists(temporary):
            os.unlink(temporary)
