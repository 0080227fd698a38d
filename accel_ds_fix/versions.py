"""The accelerate and DeepSpeed versions this package is tested with, checked through package metadata."""

import os
import sys
import warnings
from importlib import metadata

# (lowest, highest) tested release of each package, both inclusive. The README's compatibility table and the
# CI matrix are made from these runs; change them together.
SUPPORTED = {
    "accelerate": ("0.15.0", "1.16.0"),
    "deepspeed": ("0.14.4", "0.19.8"),
}

# DeepSpeed releases whose ZeRO-3 NVMe gradient swap nvme/host_gradients.py was written against and tested with.
NVME_GRADIENTS_IN_RAM = ("0.19.8", "0.19.8")
# DeepSpeed releases whose pipelined NVMe optimizer swapper nvme/pipelined_swap.py was written against and tested with.
PIPELINED_SWAP_RELEASE = ("0.19.8", "0.19.8")
# DeepSpeed releases whose ZeRO-3 sub group swapping nvme/sub_groups_in_ram.py was written against and tested with.
NVME_SUB_GROUPS_IN_RAM = ("0.19.8", "0.19.8")

# DeepSpeed releases whose CPU shm op processes/shm_segments.py was checked against: the segment name
# (shm.cpp), the LOCAL_SIZE condition (shm_interface.cpp) and TorchBackend.__init__ are the same in 0.14.4 and
# 0.19.8 (installed) and in every tag from 0.14.2 to 0.19.5; before 0.14.2 TorchBackend made no segment.
DEEPSPEED_SHM_SEGMENT_NAMES = ("0.14.4", "0.19.8")

# accelerate before this release puts DeepSpeed on CUDA (or XPU) only: AcceleratorState calls
# torch.cuda.set_device, which fails on a CPU-only machine before prepare() is ever reached.
ACCELERATE_DEEPSPEED_ON_CPU = "0.29.0"


def _release(version):
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():  # 1.0.0rc1: stop at the pre-release
            break
    return tuple(parts + [0] * (3 - len(parts)))


# Found versions, kept: the NVMe patches ask on every sub group's swap (a metadata lookup reads the disk), and the
# package a process has imported does not change under it. A package not found is asked again: it may be
# installed later in the same process (a notebook's %pip install).
_found = {}


def installed_version(package):
    if package not in _found:
        try:
            _found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            return None
    return _found[package]


def older_than(package, release):
    """Whether the installed ``package`` is a release before ``release`` (False when it is not installed)."""
    version = installed_version(package)
    return version is not None and _release(version) < _release(release)


def in_range(package, bounds):
    """Whether the installed ``package`` is within ``bounds`` (lowest, highest), both inclusive."""
    version = installed_version(package)
    return version is not None and _release(bounds[0]) <= _release(version) <= _release(bounds[1])


def untested(package, version):
    """A sentence saying why ``version`` is outside the tested range, or None when it is inside."""
    low, high = SUPPORTED[package]
    if version is None:
        return None
    if _release(low) <= _release(version) <= _release(high):
        return None
    return (
        f"accel_ds_fix is tested with {package} {low} to {high}, but {version} is installed; it may work, "
        f"and if it fails, install a tested version (pip install '{package}>={low},<={high}')."
    )


def cpu_limit(accelerate_version, cuda_available):
    """A sentence when this accelerate cannot run DeepSpeed on this machine's devices, else None."""
    if cuda_available or accelerate_version is None:
        return None
    if _release(accelerate_version) >= _release(ACCELERATE_DEEPSPEED_ON_CPU):
        return None
    return (
        f"accelerate {accelerate_version} runs DeepSpeed on CUDA devices only (it calls torch.cuda.set_device), "
        f"and no CUDA device is available: Accelerator() will fail. On a CPU-only machine use accelerate >= "
        f"{ACCELERATE_DEEPSPEED_ON_CPU}."
    )


def _package_dir(name):
    module = sys.modules.get(name)
    return os.path.dirname(module.__file__) + os.sep if getattr(module, "__file__", None) else None


def _user_stacklevel():
    """The stacklevel of the first caller outside this package, wrapt, accelerate, DeepSpeed and importlib:
    the script's own `import` line, which the warning then names instead of a line of ours."""
    inside = tuple(filter(None, (_package_dir(n) for n in (__package__, "wrapt", "accelerate", "deepspeed"))))
    frame, level = sys._getframe(2), 2  # level 1 is warn_if_untested, which calls warnings.warn
    while frame.f_back is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back  # warnings skips importlib's frames when it counts the stacklevel
            continue
        if not name.startswith(inside) and not name.startswith("<frozen "):
            break
        frame, level = frame.f_back, level + 1
    return level


def warn_if_untested():
    messages = [untested(package, installed_version(package)) for package in SUPPORTED]
    torch = sys.modules.get("torch")  # accelerate imported it already; never import it here
    if torch is not None:
        messages.append(cpu_limit(installed_version("accelerate"), torch.cuda.is_available()))
    for message in filter(None, messages):
        warnings.warn(message, RuntimeWarning, stacklevel=_user_stacklevel())
