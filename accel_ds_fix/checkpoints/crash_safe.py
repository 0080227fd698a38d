"""Crash-safe checkpoints of merged engines: save_state writes beside the folder and moves the result into place
only when it is whole; load_state refuses, before loading anything, a folder that is not what a save wrote.

accelerate and DeepSpeed write a checkpoint file by file into the folder given, over the previous one: a save
killed half-way (kill -9, an OOM kill, a power cut) leaves a folder mixing two saves, and a later load_state
takes it without a word. Here the save goes into ``.accel_ds_fix-partial.<folder>`` beside it (same filesystem), the
manifest is written last with every file's size and sha256, everything is fsynced, and only then the previous
folder is swapped out (renamed to ``.accel_ds_fix-old.<folder>``, the new one renamed in, the old one deleted).
A whole-file sha256 costs one read of the checkpoint at save and at load (the file is still in the page cache
after the save; about 1 GB/s a core): a size check alone would not see a file rewritten in place or altered.
"""

import errno
import hashlib
import logging
import os
import shutil

from .. import notices
from ..errors import CheckpointError
from . import manifest

PARTIAL = ".accel_ds_fix-partial."
OLD = ".accel_ds_fix-old."
_CHUNK = 16 << 20


def is_temporary(name):
    # A prefix, not a suffix: scripts sort their checkpoint-N folders by int(name.split("-")[1]) (diffusers).
    # A checkpoint's universal copy (universal_copy.py) is no checkpoint either.
    return name.startswith((PARTIAL, OLD, ".accel_ds_fix-universal.", ".accel_ds_fix-converting."))


def _beside(target, prefix):
    target = os.path.normpath(target)
    return os.path.join(os.path.dirname(target), prefix + os.path.basename(target))


def _gib(size):
    if size < 2**20:
        return f"{size / 1024:.1f} KiB"
    return f"{size / 2**30:.2f} GiB" if size >= 2**26 else f"{size / 2**20:.1f} MiB"


def _relative_files(directory):
    found = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        found += [os.path.relpath(os.path.join(root, f), directory).replace(os.sep, "/") for f in files]
    return sorted(found)


def _digest(path, sync=False):
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            sha.update(block)
        if sync:
            os.fsync(f.fileno())  # flushes the file whichever process wrote it
    return sha.hexdigest()


def _fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size(directory):
    return sum(os.path.getsize(os.path.join(directory, f)) for f in _relative_files(directory))


def _files(directory, kept):
    """{relative path: {"size", "sha256"}} of every file the save wrote (not the manifest, not ``kept``), all
    flushed to the disk, folders included."""
    listed = {}
    for rel in _relative_files(directory):
        if rel == manifest.FILENAME or rel.split("/")[0] in kept:
            continue
        path = os.path.join(directory, rel)
        listed[rel] = {"size": os.path.getsize(path), "sha256": _digest(path, sync=True)}
    for root, _, _ in os.walk(directory):
        _fsync_dir(root)
    return listed


def problems(directory, content):
    """What differs between ``directory`` and the file list of its manifest (format 3); [] when it is whole."""
    listed, kept = content["files"], set(content.get("kept", []))
    present = {rel for rel in _relative_files(directory) if rel != manifest.FILENAME and rel.split("/")[0] not in kept}
    found = [f"missing {rel}" for rel in sorted(set(listed) - present)]
    found += [f"not written by the save: {rel}" for rel in sorted(present - set(listed))]
    for rel in sorted(present & set(listed)):
        path = os.path.join(directory, rel)
        size = os.path.getsize(path)
        if size != listed[rel]["size"]:
            found.append(f"{rel} has {size} bytes instead of {listed[rel]['size']}")
        elif _digest(path) != listed[rel]["sha256"]:
            found.append(f"{rel} has other contents than the save wrote (sha256 differs)")
    return found


def _whole(directory):
    content = manifest.read(directory)
    return content is not None and "files" in content and not problems(directory, content)


def newest_whole_beside(directory):
    """The newest folder beside ``directory`` (temporary ones included) whose manifest verifies, or None."""
    parent = os.path.dirname(os.path.abspath(directory))
    me = os.path.abspath(directory)
    candidates = []
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        path = os.path.join(parent, name)
        if path != me and os.path.isfile(os.path.join(path, manifest.FILENAME)):
            candidates.append((os.path.getmtime(os.path.join(path, manifest.FILENAME)), path))
    return next((path for _, path in sorted(candidates, reverse=True) if _whole(path)), None)


def leftovers(directory):
    return [p for p in (_beside(directory, PARTIAL), _beside(directory, OLD)) if os.path.lexists(p)]


def _refusal(directory, what):
    parts = [f"accel_ds_fix: refusing to load {directory}: {what}. Nothing was loaded."]
    left = leftovers(directory)
    if left:
        parts.append(f"Left by a save_state into it that did not finish: {', '.join(left)} (the next save_state "
                     "there clears what is left).")
    whole = newest_whole_beside(directory)
    parts.append(f"The newest whole checkpoint beside it is {whole}." if whole
                 else "No whole checkpoint was found beside it.")
    return CheckpointError(" ".join(parts))


def check_whole(directory):
    """Before load_state loads anything: raise CheckpointError unless ``directory`` is exactly what a save wrote.
    A checkpoint of an earlier release (manifest without a file list) or without a manifest passes here:
    manifest.check says what it holds."""
    if not os.path.isdir(directory):
        if leftovers(directory):
            raise _refusal(directory, "the folder does not exist: a save_state into it was killed while it "
                                      f"replaced the folder; rename a whole one to {directory} to resume from it")
        return
    try:
        content = manifest.read(directory)
    except ValueError:
        raise _refusal(directory, f"its {manifest.FILENAME} is not readable JSON (a save was cut off)") from None
    if content is None or "files" not in content:
        return
    found = problems(directory, content)
    if found:
        shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
        raise _refusal(directory, f"it is not the checkpoint save_state wrote there (partial, mixed or altered): "
                                  f"{shown}")


def _recover(target):
    """Before a save: put back what a save killed between its two renames left, clear a killed save's folder."""
    old, partial = _beside(target, OLD), _beside(target, PARTIAL)
    if os.path.lexists(old):
        if os.path.lexists(target):
            shutil.rmtree(old)
        else:
            os.rename(old, target)
    if os.path.lexists(partial):
        notices.say(f"clearing {partial}, left by a save_state into {target} that did not finish",
                    level=logging.WARNING)
        shutil.rmtree(partial)


def _estimate(target):
    """Bytes the save will need: the size of the checkpoint it replaces, else of the newest one beside it."""
    if os.path.isdir(target):
        return _size(target)
    whole = newest_whole_beside(target)
    content = manifest.read(whole) if whole else None
    return sum(f["size"] for f in content["files"].values()) if content else None


def _room_check(target):
    needed = _estimate(target)
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(target))).free
    if needed is not None and needed > free:
        raise CheckpointError(
            f"accel_ds_fix: save_state({target}) needs about {_gib(needed)} (the size of the checkpoint there) "
            f"and the disk has {_gib(free)} free. The previous checkpoint stays until the new one is whole, so "
            "both must fit; nothing was written. Free some space or save elsewhere."
        )
    return free


def _kept(target, partial):
    """Top-level entries of the folder being replaced that the save did not write and that are no part of its
    previous checkpoint (a script's own files there): they are moved into the new folder, never deleted."""
    if not os.path.isdir(target):
        return []
    content = manifest.read(target) if os.path.isfile(os.path.join(target, manifest.FILENAME)) else None
    if content is not None and "files" in content:
        previous = {rel.split("/")[0] for rel in content["files"]} | {manifest.FILENAME}
        previous -= set(content.get("kept", []))
    else:
        previous = {manifest.FILENAME}  # an earlier release's or accelerate's own folder: keep all it has
    written = set(os.listdir(partial))
    return sorted(set(os.listdir(target)) - written - previous)


def _replace(partial, target, kept):
    parent = os.path.dirname(os.path.abspath(target))
    if os.path.lexists(target):
        old = _beside(target, OLD)
        os.rename(target, old)
        os.rename(partial, target)
        _fsync_dir(parent)
        for name in kept:
            os.rename(os.path.join(old, name), os.path.join(target, name))
        shutil.rmtree(old)
    else:
        os.rename(partial, target)
    _fsync_dir(parent)


def _disk_full(exc):
    while exc is not None:
        text = str(exc)
        if getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def save(accelerator, target, save_into, write_manifest):
    """Run ``save_into(folder)`` (accelerate's save_state, on every process) into a temporary folder beside
    ``target``, then ``write_manifest(folder, files, kept)`` on the main process, and move it into place once."""
    partial = _beside(target, PARTIAL)
    main = accelerator.is_main_process
    free, placed = None, False
    if main:
        _recover(target)
        free = _room_check(target)
    accelerator.wait_for_everyone()
    try:
        os.makedirs(partial, exist_ok=True)
        location = save_into(partial)
        accelerator.wait_for_everyone()
        if main:
            kept = _kept(target, partial)
            write_manifest(partial, _files(partial, kept), kept)
            _fsync_dir(partial)
            _replace(partial, target, kept)
            placed = True
        accelerator.wait_for_everyone()
    except KeyboardInterrupt as exc:
        if placed:
            raise  # the new checkpoint is in place: the save finished
        _discard(main, partial)
        raise KeyboardInterrupt(
            f"accel_ds_fix: save_state({target}) was interrupted (Ctrl-C) before it finished: nothing of it was "
            f"kept{_untouched(target)}."
        ) from exc
    except Exception as exc:
        if placed:
            raise
        # torch.save's C++ writer says only "file write failed" on a full disk: then the disk's free space tells
        free_now = shutil.disk_usage(os.path.dirname(os.path.abspath(target))).free
        if not (_disk_full(exc) or (free_now < 64 << 20 and "write failed" in str(exc))):
            _discard(main, partial)
            raise
        written = _size(partial) if os.path.isdir(partial) else 0
        _discard(main, partial)
        needed = _estimate(target)
        need = f"about {_gib(needed)}" if needed else f"more than the {_gib(written)} it had written"
        had = f"{_gib(free)} free when it started" if free is not None else "too little free"
        raise CheckpointError(
            f"accel_ds_fix: save_state({target}) ran out of disk space (ENOSPC) after writing {_gib(written)}: it "
            f"needed {need} and the disk of {os.path.dirname(os.path.abspath(target))} had {had}. Nothing of it "
            f"was kept{_untouched(target)}. Free some space or save elsewhere."
        ) from exc
    return location


def _untouched(target):
    return f"; the previous checkpoint at {target} is untouched" if os.path.isdir(target) else ""


def _discard(main, partial):
    if main and os.path.lexists(partial):
        shutil.rmtree(partial, ignore_errors=True)
