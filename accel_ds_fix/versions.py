"""The accelerate and DeepSpeed versions this package is tested with, checked through package metadata."""

import warnings
from importlib import metadata

# (lowest, highest) tested release of each package, both inclusive. The README's compatibility table and the
# CI matrix are made from these runs; change them together.
SUPPORTED = {
    "accelerate": ("0.15.0", "1.15.0"),
    "deepspeed": ("0.10.0", "0.19.8"),
}


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


def installed_version(package):
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


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


def warn_if_untested():
    for package in SUPPORTED:
        message = untested(package, installed_version(package))
        if message:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
