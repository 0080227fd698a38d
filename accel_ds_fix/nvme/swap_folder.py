"""The NVMe swap folder across runs: which swap files belong to a live run and which a dead one left.

DeepSpeed swaps each process's optimizer states into ``<nvme_path>/zero_stage_3/optimizer/rank<R>/`` (parameters
into ``zero_stage_3/<dtype>params/rank<R>/``) and never removes them: a run killed with kill -9 leaves its
gigabytes there, and a second run on the same folder writes over the first one's states. Nothing reads a swap file
once its process is gone: a checkpoint keeps its own copy (``offloaded_tensors``).

Each process of a run holds an flock on ``<nvme_path>/.accel_ds_fix-swap.rank<R>.lock`` from prepare() until it
exits; the kernel drops it when the process dies, kill -9 included. So a rank whose lock is held belongs to a live
run (another run on the folder is refused before anything is allocated), and a rank folder whose lock is free
holds what a dead run left: the run that takes that rank removes it first (its room counts as free, said in one
line), a clean exit removes the run's own, and `python -m accel_ds_fix clean-swap DIR` removes the rest.
"""

import atexit
import fcntl
import json
import os
import re
import shutil
import sys
import time

from ..errors import ConfigError

_LOCK = ".accel_ds_fix-swap.rank{}.lock"
_held = {}  # (real nvme_path, rank): open lock file of this process


def _lock_path(folder, rank):
    return os.path.join(folder, _LOCK.format(rank))


def rank_folders(folder):
    """{rank: [folders]} of DeepSpeed's per-process swap folders under ``folder``."""
    found = {}
    base = os.path.join(folder, "zero_stage_3")
    for kind in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        for name in sorted(os.listdir(os.path.join(base, kind))) if os.path.isdir(os.path.join(base, kind)) else []:
            match = re.fullmatch(r"rank(\d+)", name)
            if match:
                found.setdefault(int(match.group(1)), []).append(os.path.join(base, kind, name))
    return found


def _size(paths):
    total = 0
    for path in paths:
        for root, _, files in os.walk(path):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files if os.path.isfile(os.path.join(root, f)))
    return total


def _try_lock(folder, rank):
    """An fd holding ``rank``'s lock of ``folder`` (close it to let go), or None where a live process holds it."""
    try:
        fd = os.open(_lock_path(folder, rank), os.O_RDONLY)
    except OSError:
        return os.open(os.devnull, os.O_RDONLY)  # never locked: nothing to hold
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def holder(folder, rank):
    """None when no other live process holds ``rank`` of ``folder``, else what its lock file says of it (a dict)."""
    if (os.path.realpath(folder), rank) in _held:
        return None  # this process: a second engine of the same run
    fd = _try_lock(folder, rank)
    if fd is not None:
        os.close(fd)
        return None
    return _lock_info(folder, rank)


def _lock_info(folder, rank):
    """What a live holder wrote into ``rank``'s lock file of ``folder`` (pid, start, command); {} where unreadable."""
    try:
        with open(_lock_path(folder, rank), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _describe(info):
    what = f"pid {info['pid']}" if "pid" in info else "another process"
    if info.get("command"):
        what += f": {info['command'][:120]}"
    if info.get("started"):
        what += f", since {time.strftime('%Y-%m-%d %H:%M', time.localtime(info['started']))}"
    return what


def claim(folder, rank):
    """Hold ``rank`` of ``folder`` for this process until it exits; ConfigError where a live run holds it."""
    key = (os.path.realpath(folder), rank)
    if key in _held:
        return
    os.makedirs(folder, exist_ok=True)
    f = _open_locked(_lock_path(folder, rank))
    if f.closed:  # another live process holds it
        raise ConfigError(
            f"accel_ds_fix: the NVMe folder {folder} is in use by another run ({_describe(_lock_info(folder, rank))}): "
            "two runs swapping into one folder overwrite each other's optimizer states. Give this run another "
            "nvme_path (the DeepSpeed config's offload_optimizer.nvme_path, or accelerate's "
            "offload_optimizer_nvme_path), or wait for that run to end. Nothing was allocated."
        ) from None
    f.seek(0)
    f.truncate()
    json.dump({"pid": os.getpid(), "started": time.time(), "command": " ".join(sys.argv)}, f)
    f.flush()
    _held[key] = f
    atexit.register(_remove_own, folder, rank)


def stale(folder, ranks=None):
    """{rank: bytes} of rank folders under ``folder`` that no live process holds (what dead runs left);
    ``ranks``: only these."""
    found = {}
    for rank, paths in rank_folders(folder).items():
        if (ranks is None or rank in ranks) and (os.path.realpath(folder), rank) not in _held:
            if holder(folder, rank) is None:
                found[rank] = _size(paths)
    return {rank: size for rank, size in found.items() if size}


def remove(folder, rank):
    """Remove the swap files of ``rank`` (its folders); the caller holds the rank or knows it is free."""
    for path in rank_folders(folder).get(rank, []):
        shutil.rmtree(path, ignore_errors=True)


def clean(folder):
    """Remove what dead runs left in ``folder``: (bytes freed, ranks held by live runs and left alone). Each rank
    is locked while its files go, so a run starting meanwhile waits for nothing and loses nothing."""
    freed, live = 0, []
    for rank, paths in sorted(rank_folders(folder).items()):
        fd = None if (os.path.realpath(folder), rank) in _held else _try_lock(folder, rank)
        if fd is None:
            live.append(rank)
            continue
        try:
            freed += _size(paths)
            remove(folder, rank)
        finally:
            os.close(fd)
    return freed, live


def _open_locked(path):
    """The lock file at ``path``, open and locked by this process; closed where a live process holds it. A file that
    its holder removed as it exited (between our open and our lock) is not the one there now: open that one."""
    while True:
        f = open(path, "a+", encoding="utf-8")  # kept open: the lock lives as long as the file
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return f
        if _same_file(f, path):
            return f
        f.close()


def _same_file(f, path):
    try:
        return os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
    except OSError:
        return False


def _remove_own(folder, rank):
    # At exit: this process's swap files are never read again (a checkpoint holds its own copy), nor is its lock
    # file; it goes while still locked, and a run that locked it meanwhile sees it gone and takes a new one.
    f = _held.pop((os.path.realpath(folder), rank), None)
    if f is not None:
        remove(folder, rank)
        try:
            os.unlink(_lock_path(folder, rank))
        except OSError:
            pass
        f.close()


def _gib(nbytes):
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**26 else f"{nbytes / 2**20:.1f} MiB"


def take(folders, rank, world_size, say):
    """In prepare(), before anything is allocated: hold this process's rank of each NVMe folder, remove what a dead
    run left in it (DeepSpeed would write over it or leave it lying), and name what dead runs left in ranks this run
    does not use (the main process, through ``say``)."""
    for folder in folders:
        claim(folder, rank)
        left = _size(rank_folders(folder).get(rank, []))  # held by this process now, not swapped into yet: a dead run's
        if left:
            remove(folder, rank)
            say(f"removed {_gib(left)} of NVMe swap files in {folder} (process {rank}) that a run which did not end "
                "cleanly left; this run swaps into their place")
        others = stale(folder, set(rank_folders(folder)) - set(range(world_size))) if rank == 0 else {}
        if others:
            say(f"{folder} also holds {_gib(sum(others.values()))} of NVMe swap files that dead runs left (process "
                f"folders {', '.join(map(str, sorted(others)))}), which this run does not use: "
                f"`python -m accel_ds_fix clean-swap {folder}` removes them")
