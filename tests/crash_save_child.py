"""Run a training script in this process with a fault in the save_state into one folder: the test's kill -9.

    ACCEL_DS_FIX_TEST_FAULT=KIND:N ACCEL_DS_FIX_TEST_FAULT_DIR=CKPT python tests/crash_save_child.py SCRIPT ARGS...

Counted are the files written into CKPT or the save's temporary folder beside it (Python's open() for writing and
torch.save to a path, which DeepSpeed and accelerate use), 1, 2, ... in the order written:
  torn:N       file N is written, cut to half its size, then the process is killed with SIGKILL (died mid-write)
  closed:N     killed with SIGKILL once file N is closed (between files); closed:0 before the first file
  rename:N     killed with SIGKILL after the N-th rename of the folders (rename:1: the old folder moved away,
               the new one not yet in place)
  interrupt:N  KeyboardInterrupt (Ctrl-C) raised as file N is opened
  sigint-rename:N  a real SIGINT (Ctrl-C) sent to the process after the N-th rename of the folders
  enospc:N     OSError(ENOSPC) raised as file N is opened (a full disk)
  fill:N       as file N is opened, the disk of the folder is filled with a file `filler` beside it, written until
               the disk says ENOSPC: the save then meets a real full disk (a small filesystem, such as a tmpfs)
  torn:NAME and closed:NAME pick the file by its path in the folder instead (torn:unet/weights.pt)
  count:PATH   nothing fails; each file's path relative to its folder is appended to PATH as it is closed
The trigger lives here, in the test's child, not in the package.
"""

import builtins
import errno
import os
import runpy
import signal
import sys

import torch

KIND, _, ARG = os.environ["ACCEL_DS_FIX_TEST_FAULT"].partition(":")
WATCH = os.path.abspath(os.environ["ACCEL_DS_FIX_TEST_FAULT_DIR"])
written = []
renames = []


def _watched(path):
    try:
        path = os.path.abspath(os.fspath(path))
    except TypeError:
        return None
    partial = os.path.join(os.path.dirname(WATCH), ".accel_ds_fix-partial." + os.path.basename(WATCH))
    for prefix in (WATCH + os.sep, partial + os.sep):
        if path.startswith(prefix):
            return path[len(prefix):]
    return None


def _kill():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _before(path, rel):
    number = len(written) + 1
    if KIND == "closed" and ARG == "0":
        _kill()
    if KIND == "interrupt" and int(ARG) == number:
        raise KeyboardInterrupt
    if KIND == "enospc" and int(ARG) == number:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    if KIND == "fill" and int(ARG) == number:
        _fill(os.path.join(os.path.dirname(WATCH), "filler"))


def _fill(path):
    block = b"\0" * (1 << 16)
    with _open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise


def _after(path, rel):
    written.append(rel)
    if KIND == "count":
        with _open(ARG, "a") as f:
            f.write(rel + "\n")
    elif KIND == "torn" and _hit(rel):
        os.truncate(path, os.path.getsize(path) // 2)
        _kill()
    elif KIND == "closed" and _hit(rel):
        _kill()


def _hit(rel):
    # N counts the files written; a name instead of a number picks the file by its path in the folder
    return int(ARG) == len(written) if ARG.isdigit() else ARG == rel


class _Tracked:
    """A file opened for writing: calls _after once it is closed."""

    def __init__(self, f, path, rel):
        self._f, self._path, self._rel = f, path, rel

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __iter__(self):
        return iter(self._f)

    def close(self):
        if not self._f.closed:
            self._f.close()
            _after(self._path, self._rel)


_open = builtins.open


def _tracked_open(file, mode="r", *args, **kwargs):
    rel = _watched(file) if isinstance(file, (str, bytes, os.PathLike)) else None
    if rel is None or not any(c in mode for c in "wax+"):
        return _open(file, mode, *args, **kwargs)
    _before(file, rel)
    return _Tracked(_open(file, mode, *args, **kwargs), file, rel)


_save = torch.save


def _tracked_save(obj, f, *args, **kwargs):
    rel = _watched(f) if isinstance(f, (str, os.PathLike)) else None
    if rel is None:
        return _save(obj, f, *args, **kwargs)
    _before(f, rel)
    result = _save(obj, f, *args, **kwargs)
    _after(f, rel)
    return result


_rename = os.rename


def _tracked_rename(src, dst, *args, **kwargs):
    result = _rename(src, dst, *args, **kwargs)
    if os.path.basename(WATCH) in os.path.basename(os.fspath(src)) + os.path.basename(os.fspath(dst)):
        renames.append((src, dst))
        if KIND == "rename" and int(ARG) == len(renames):
            _kill()
        if KIND == "sigint-rename" and int(ARG) == len(renames):
            os.kill(os.getpid(), signal.SIGINT)
    return result


builtins.open = _tracked_open
torch.save = _tracked_save
os.rename = _tracked_rename

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
