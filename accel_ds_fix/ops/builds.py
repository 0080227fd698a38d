"""Where DeepSpeed's JIT-compiled C++ ops (cpu_adam for optimizer offload, ...) live, whether one is built, and
building them ahead of time (`python -m accel_ds_fix build-ops`), so no first run stalls in prepare()."""

import os
import time

from . import libaio

# The ops the shipped tiers load, as DeepSpeed's accelerators name their builders: cpu_adam for optimizer offload,
# async_io (with pin_memory) for the NVMe tier, and the shared-memory collectives DeepSpeed loads at every start
# on the CPU backend. An op this accelerator does not have, or cannot build here, is skipped with the reason.
TIER_BUILDERS = ("CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder")

_building_ahead = False  # build() reports each op itself: the first-build notice (first_build_notice.py) stays quiet


def building_ahead():
    return _building_ahead


def build_directory(name):
    """The folder torch.utils.cpp_extension builds (and caches) the op ``name`` in."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def _processes_with(predicate):
    """Whether a live process matches ``predicate(pid)``, which reads /proc links; None without /proc."""
    if not os.path.isdir("/proc"):
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if predicate(pid):
                return True
        except OSError:  # gone meanwhile, or another user's
            continue
    return False


def clear_stale_lock(name, wait_seconds=1800):
    """torch builds an op under a lock file that only its Python process removes: a build killed halfway (an
    OOM kill, kill -9, a power cut) leaves it, and every later run then waits on it forever, silently. A lock
    that no live process holds open is stale: once the killed build's own compilers (still running in the folder)
    are done, it is removed. Returns whether it was."""
    folder = os.path.realpath(build_directory(name))
    lock = os.path.join(folder, "lock")
    if not os.path.exists(lock):
        return False
    held = _processes_with(lambda pid: any(os.readlink(f"/proc/{pid}/fd/{fd}") == lock
                                           for fd in os.listdir(f"/proc/{pid}/fd")))
    if held is not False:
        return False
    deadline = time.monotonic() + wait_seconds
    while _processes_with(lambda pid: os.readlink(f"/proc/{pid}/cwd") == folder) and time.monotonic() < deadline:
        time.sleep(1)
    os.unlink(lock)
    return True


def prebuilt(name):
    """Whether the installed DeepSpeed was built with this op (DS_BUILD_OPS), so nothing is compiled."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return False
    return bool(installed_ops.get(name, False))


def is_built(name):
    return prebuilt(name) or os.path.exists(os.path.join(build_directory(name), f"{name}.so"))


def location(name):
    """Where the op ``name`` comes from, in words."""
    return "installed with DeepSpeed" if prebuilt(name) else build_directory(name)


def build(builder_names=TIER_BUILDERS, report=print):
    """Build each op unless built; ``report`` gets one line per op. Returns False if one failed to build."""
    global _building_ahead
    from deepspeed.accelerator import get_accelerator

    libaio.activate()  # a libaio unpacked without root (get-libaio), for the async_io op
    ok, _building_ahead = True, True
    try:
        for class_name in builder_names:
            ok = _build_one(get_accelerator(), class_name, report) and ok
    finally:
        _building_ahead = False
    return ok


def _build_one(accelerator, class_name, report):
    builder_class = accelerator.get_op_builder(class_name)
    name = getattr(builder_class, "NAME", None)
    if builder_class is None or name in (None, "deepspeed_not_implemented"):
        report(f"{class_name}: not used by DeepSpeed's {accelerator.device_name()} accelerator, skipped")
        return True
    if is_built(name):
        report(f"{name}: already built ({location(name)})")
        return True
    builder = builder_class()
    if not builder.is_compatible(verbose=False):
        why = f"libaio is missing: the zero3-nvme tier cannot run here ({libaio.INSTALL_HINT})" \
            if name == "async_io" else "DeepSpeed says it is not compatible with this machine"
        report(f"{name}: cannot be built here: {why}")
        return True
    if clear_stale_lock(name):
        report(f"{name}: removed the lock of a build that was killed halfway ({build_directory(name)})")
    report(f"{name}: building (a few minutes on a small machine) ...")
    started = time.monotonic()
    try:
        builder.load(verbose=False)
    except Exception as exc:  # a compiler error: say which op; the others can still be built
        report(f"{name}: FAILED: {exc!r}")
        return False
    report(f"{name}: built in {time.monotonic() - started:.0f} s into {build_directory(name)}")
    return True
