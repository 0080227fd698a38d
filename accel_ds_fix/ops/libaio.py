"""libaio for DeepSpeed's async_io op (the NVMe tier) where the system has none and the user has no root:
Debian's packages unpacked into a folder (`python -m accel_ds_fix get-libaio`), which the fix then puts on the
compiler's, linker's and loader's paths of the process that builds or loads the op.

The folder is ``$ACCEL_DS_FIX_LIBAIO``, else ``~/.cache/accel_ds_fix/libaio`` (``$XDG_CACHE_HOME`` honoured).
"""

import ctypes
import ctypes.util
import glob
import os
import shutil
import subprocess
import tempfile

ENV = "ACCEL_DS_FIX_LIBAIO"
HEADER = os.path.join("usr", "include", "libaio.h")
INSTALL_HINT = (
    "install libaio: Debian/Ubuntu `sudo apt install libaio-dev`; Fedora/RHEL `sudo dnf install libaio-devel`; "
    "conda `conda install -c conda-forge libaio`, then `export CFLAGS=-I$CONDA_PREFIX/include "
    "LDFLAGS=-L$CONDA_PREFIX/lib LD_LIBRARY_PATH=$CONDA_PREFIX/lib` before the run; without root on Debian or "
    "Ubuntu: `python -m accel_ds_fix get-libaio` (unpacks Debian's packages into your cache; the fix finds them)"
)

_activated = None


class LibaioError(RuntimeError):
    """libaio could not be fetched; the message says why and what to do instead."""


def default_folder():
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "accel_ds_fix", "libaio")


def local_folder():
    """The unpacked libaio the fix may use, or None where there is none."""
    folder = os.environ.get(ENV) or default_folder()
    return folder if local_folder_at(folder) else None


def _library_dir(folder):
    found = sorted(glob.glob(os.path.join(folder, "usr", "lib", "**", "libaio.so*"), recursive=True))
    return os.path.dirname(found[0]) if found else None


def _runtime_library(folder):
    libdir = _library_dir(folder)
    names = sorted(glob.glob(os.path.join(libdir, "libaio.so.*"))) if libdir else []
    return names[0] if names else None


def on_system():
    """Whether the system's own libaio (header and library) is there for compiler and loader."""
    headers = ("/usr/include/libaio.h", "/usr/local/include/libaio.h")
    return any(os.path.exists(h) for h in headers) and ctypes.util.find_library("aio") is not None


def _prepend(variable, value, separator=os.pathsep):
    current = os.environ.get(variable, "")
    if value not in current.split(separator):
        os.environ[variable] = value + (separator + current if current else "")


def activate():
    """Put the local libaio (if any) on this process's build and load paths; return its folder or None.

    The compiler and linker DeepSpeed starts read CPATH / LIBRARY_PATH (and its own compatibility check reads
    CFLAGS / LDFLAGS); the loader read LD_LIBRARY_PATH when the process started, so the library is loaded here
    once, globally: the op's own dependency on libaio.so.1 is then already satisfied when torch loads it."""
    global _activated
    if _activated is not None:
        return _activated
    folder = local_folder()
    if folder is None or on_system():
        return None
    include, libdir = os.path.join(folder, "usr", "include"), _library_dir(folder)
    if libdir is None:
        return None
    try:
        ctypes.CDLL(_runtime_library(folder), mode=ctypes.RTLD_GLOBAL)
    except OSError:  # a damaged folder: as if there were none (the NVMe check then says libaio is missing)
        return None
    _prepend("CPATH", include)
    _prepend("LIBRARY_PATH", libdir)
    _prepend("CFLAGS", f"-I{include}", " ")
    _prepend("LDFLAGS", f"-L{libdir}", " ")
    _activated = folder
    return folder


def _private_state(state):
    # A private package list and cache: works without root and leaves the system's apt state alone.
    return ["-o", f"Dir::State::Lists={state}/lists", "-o", f"Dir::Cache={state}/cache"]


def _apt(*args, state):
    options = _private_state(state) + ["-o", "Debug::NoLocking=1"]
    if os.geteuid() == 0:  # apt's _apt user cannot enter a private temporary folder
        options += ["-o", "APT::Sandbox::User=root"]
    return subprocess.run(["apt-get", *options, *args], capture_output=True, text=True, timeout=600, cwd=state)


def _runtime_package(state):
    proc = subprocess.run(["apt-cache", *_private_state(state), "depends", "libaio-dev"], capture_output=True,
                          text=True, timeout=120)
    for line in proc.stdout.splitlines():
        name = line.strip().removeprefix("Depends:").strip()
        if line.strip().startswith("Depends:") and name.startswith("libaio1"):
            return name
    return "libaio1"


def fetch(folder=None, report=print):
    """Download Debian's libaio-dev and its library package and unpack them into ``folder``; return it."""
    folder = os.path.abspath(folder or os.environ.get(ENV) or default_folder())
    if local_folder_at(folder):
        report(f"libaio: already in {folder}")
        return folder
    missing = [tool for tool in ("apt-get", "apt-cache", "dpkg-deb") if shutil.which(tool) is None]
    if missing:
        raise LibaioError(f"cannot fetch libaio here: {', '.join(missing)} not found (not Debian or Ubuntu): "
                          + INSTALL_HINT.split("; without root")[0])
    with tempfile.TemporaryDirectory() as state:
        for sub in ("lists/partial", "cache/archives/partial"):
            os.makedirs(os.path.join(state, sub))
        steps = [("update",), ("download", "libaio-dev")]
        for step in steps:
            proc = _apt(*step, state=state)
            if proc.returncode != 0:
                raise LibaioError(f"cannot fetch libaio: `apt-get {' '.join(step)}` failed: "
                                  f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}. Or {INSTALL_HINT}")
            if step == ("update",):
                steps.append(("download", _runtime_package(state)))
        # Unpacked beside the folder and moved into place whole: a fetch killed halfway leaves no folder that
        # looks complete (a header beside a truncated library would break every later run's load).
        for leftover in glob.glob(f"{folder}.partial-*"):  # of fetches killed before
            shutil.rmtree(leftover, ignore_errors=True)
        partial = f"{folder}.partial-{os.getpid()}"
        os.makedirs(os.path.dirname(folder), exist_ok=True)  # ~/.cache/accel_ds_fix on a first fetch
        for deb in sorted(glob.glob(os.path.join(state, "*.deb"))):
            subprocess.run(["dpkg-deb", "-x", deb, partial], check=True, timeout=120)
        if not local_folder_at(partial) or _runtime_library(partial) is None:
            shutil.rmtree(partial, ignore_errors=True)
            raise LibaioError("unpacked Debian's libaio, but libaio.h or libaio.so.1 is not in it")
        shutil.rmtree(folder, ignore_errors=True)  # incomplete (local_folder_at said so), e.g. made by hand
        os.rename(partial, folder)
    report(f"libaio: unpacked into {folder}")
    return folder


def local_folder_at(folder):
    return os.path.exists(os.path.join(folder, HEADER)) and _library_dir(folder) is not None
