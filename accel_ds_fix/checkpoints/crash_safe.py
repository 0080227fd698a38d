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

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import threading

from .. import notices
from ..errors import CheckpointError
from ..units import size_in_words as _gib
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
    try:
        content = manifest.read(directory)
    except ValueError:  # a manifest cut off mid-write
        return False
    return content is not None and "files" in content and not problems(directory, content)


def newest_whole_beside(directory):
    """The newest checkpoint folder beside ``directory`` whose manifest verifies, or None. A save's temporary
    folders are no checkpoints to name: load_state puts a whole one in place itself (recover)."""
    parent = os.path.dirname(os.path.abspath(directory))
    me = os.path.abspath(directory)
    candidates = []
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        path = os.path.join(parent, name)
        if path != me and not is_temporary(name) and os.path.isfile(os.path.join(path, manifest.FILENAME)):
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


def _saved_into(directory):
    """The folder a save's temporary folder ``directory`` stands beside, or None for any other folder."""
    name = os.path.basename(os.path.normpath(directory))
    for prefix in (PARTIAL, OLD):
        if name.startswith(prefix):
            return os.path.join(os.path.dirname(os.path.normpath(directory)), name[len(prefix):])
    return None


def _instead(directory, target):
    """What to load instead of ``directory``, a temporary folder of a save into ``target``, in words: the target itself where
    recover() would put a whole checkpoint there (the one the save wrote, else the previous one), as load_state
    does before it loads; else the newest whole checkpoint beside it."""
    old, partial = _beside(target, OLD), _beside(target, PARTIAL)
    if not os.path.lexists(target):
        if os.path.isdir(partial) and _whole(partial):
            return (f"load_state({target}) resumes the checkpoint that save wrote: its files are whole (checked "
                    "against its manifest), and the load puts it in place first.")
        if os.path.isdir(old):
            return (f"load_state({target}) resumes the previous checkpoint there, which the load puts back in "
                    "place first.")
    whole = newest_whole_beside(directory)  # the folder it was saving into counts
    return (f"The newest whole checkpoint beside it is {whole}." if whole
            else "No whole checkpoint was found beside it.")


@dataclasses.dataclass(frozen=True)
class Verified:
    """What check_whole verified, for the loaders to take instead of reading the manifest again: the folder, its
    manifest's content (None: a folder without one) and the sha256 of the manifest as written, which names the
    checkpoint's content (it lists every file's sha256)."""

    path: str
    content: object
    digest: object


def check_whole(directory):
    """Before load_state loads anything: raise CheckpointError unless ``directory`` is exactly what a save wrote;
    return what was verified (None where the folder does not exist: accelerate's own load says so). A checkpoint
    of an earlier release (manifest without a file list) or without a manifest passes here: manifest.check says
    what it holds. Run recover(directory) first: what a save cut off in its folder swap is then in place."""
    target = _saved_into(directory)
    if target is not None:
        raise CheckpointError(
            f"accel_ds_fix: refusing to load {directory}: it is the temporary folder of a save_state into {target} "
            "that did not finish (killed or interrupted), not a checkpoint. Nothing was loaded. "
            + _instead(directory, target)
        )
    if not os.path.isdir(directory):
        if leftovers(directory):
            raise _refusal(directory, "the folder does not exist, and what a save_state into it left holds no "
                                      "whole checkpoint")
        return None
    raw = manifest.read_bytes(directory)
    try:
        content = None if raw is None else json.loads(raw)
    except ValueError:
        raise _refusal(directory, f"its {manifest.FILENAME} is not readable JSON (a save was cut off)") from None
    found = problems(directory, content) if content is not None and "files" in content else []
    if found:
        shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
        raise _refusal(directory, f"it is not the checkpoint save_state wrote there (partial, mixed or altered): "
                                  f"{shown}")
    return Verified(directory, content, None if raw is None else hashlib.sha256(raw).hexdigest())


def recover(target):
    """Finish what a save cut off in its folder swap left (kill -9 or Ctrl-C between or after its renames), on
    the main process, before a load or the next save: the new checkpoint where it was whole, else the previous
    one, goes in place, and a script's own files still in the previous folder move into it. Returns what it
    did, in words (None: nothing to do)."""
    old, partial = _beside(target, OLD), _beside(target, PARTIAL)
    done = None
    if not os.path.lexists(target) and (os.path.lexists(old) or os.path.isdir(partial)):
        if os.path.isdir(partial) and _whole(partial):
            os.rename(partial, target)
            done = (f"put the checkpoint that a save_state cut off at its end had written in place at {target} (its "
                    "files are whole: checked against its manifest)")
        elif os.path.lexists(old):
            os.rename(old, target)
            done = (f"put the previous checkpoint back at {target}: the save_state that was replacing it did not "
                    "finish")
        _fsync_dir(os.path.dirname(os.path.abspath(target)))
    if os.path.lexists(old):  # the new checkpoint is in place: bring over what the save kept, drop the rest
        content = manifest.read(target) if os.path.isfile(os.path.join(target, manifest.FILENAME)) else None
        for name in (content or {}).get("kept", []):
            if os.path.lexists(os.path.join(old, name)) and not os.path.lexists(os.path.join(target, name)):
                os.rename(os.path.join(old, name), os.path.join(target, name))
        shutil.rmtree(old)
    if done:
        notices.say(done, level=logging.WARNING)
    return done


def _clear_partial(target):
    partial = _beside(target, PARTIAL)
    if os.path.lexists(partial):
        notices.say(f"clearing {partial}, left by a save_state into {target} that did not finish",
                    level=logging.WARNING)
        shutil.rmtree(partial)


def _saved_bytes(directory):
    """What the checkpoint in ``directory`` holds: its manifest's files (a script's own files kept there are moved,
    not written again), else the whole folder."""
    try:
        content = manifest.read(directory)
    except ValueError:
        content = None
    if content is not None and "files" in content:
        return sum(f["size"] for f in content["files"].values())
    return _size(directory)


def _room_check(target, size_estimate):
    """(free bytes of the target's disk, bytes the save is expected to write or None): the checkpoint it replaces
    at the target (an earlier save of the same run), else this run's weights and optimizer states
    (``size_estimate()``, a lower bound). CheckpointError where the save surely cannot fit: the smaller of the two
    exceeds the free space. Another checkpoint beside the target (another run's, of another size) says nothing
    about this save."""
    at_least = size_estimate() if size_estimate is not None else None
    previous = _saved_bytes(target) if os.path.isdir(target) else None
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(target))).free
    known = [(size, why) for size, why in ((at_least, "this run's weights and optimizer states"),
                                           (previous, "the size of the checkpoint there")) if size is not None]
    needed, sized_by = min(known, key=lambda size: size[0]) if known else (None, None)
    if needed is not None and needed > free:
        stays = (" The previous checkpoint stays until the new one is whole, so both must fit; nothing was written."
                 if previous is not None else " Nothing was written.")
        raise CheckpointError(
            f"accel_ds_fix: save_state({target}) needs about {_gib(needed)} ({sized_by}) and the disk has "
            f"{_gib(free)} free.{stays} Free some space or save elsewhere."
        )
    return free, previous if previous is not None else at_least


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


def _swap_in(partial, target):
    """The new folder in place of the previous one (moved to OLD beside it). A kill between the two renames is
    finished by recover(); Ctrl-C waits for both (_ctrl_c_deferred)."""
    if os.path.lexists(target):
        os.rename(target, _beside(target, OLD))
    os.rename(partial, target)
    _fsync_dir(os.path.dirname(os.path.abspath(target)))


def _drop_previous(target, kept):
    """After _swap_in: a script's own files of the previous folder move into the new one, the rest goes."""
    old = _beside(target, OLD)
    if os.path.lexists(old):
        for name in kept:
            os.rename(os.path.join(old, name), os.path.join(target, name))
        shutil.rmtree(old)
        _fsync_dir(os.path.dirname(os.path.abspath(target)))


@contextlib.contextmanager
def _ctrl_c_deferred():
    """Ctrl-C (SIGINT) while the block runs is raised when it ends, so that the folder swap is never cut between
    its two renames by a KeyboardInterrupt. Only the main thread can take signals; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: came.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if came:
        raise KeyboardInterrupt


def _disk_full(exc):
    return any(getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e) for e in _chain(exc))


def save(accelerator, target, save_into, write_manifest, size_estimate=None):
    """Run ``save_into(folder)`` (accelerate's save_state, on every process) into a temporary folder beside
    ``target``, then ``write_manifest(folder, files, kept)`` on the main process, and move it into place once.
    ``size_estimate()``: at least the bytes a save of these models writes, for the room check ahead and a full
    disk's message where no earlier checkpoint at the target tells."""
    partial = _beside(target, PARTIAL)
    main = accelerator.is_main_process
    free, needed, placed = None, None, False
    if main:
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)  # as accelerate's save_state does
        recover(target)
        _clear_partial(target)
        free, needed = _room_check(target, size_estimate)
    accelerator.wait_for_everyone()
    try:
        os.makedirs(partial, exist_ok=True)
        location = save_into(partial)
        accelerator.wait_for_everyone()
        if main:
            kept = _kept(target, partial)
            write_manifest(partial, _files(partial, kept), kept)
            _fsync_dir(partial)
            with _ctrl_c_deferred():
                _swap_in(partial, target)
                placed = True
            _drop_previous(target, kept)
        accelerator.wait_for_everyone()
    except KeyboardInterrupt as exc:
        if placed:
            if main:
                recover(target)  # what _drop_previous had left to do
            raise KeyboardInterrupt(
                f"accel_ds_fix: save_state({target}) was interrupted (Ctrl-C) as it finished: the new checkpoint is in "
                f"place at {target} and whole (its manifest lists every file)."
            ) from exc
        _discard(main, partial)
        raise KeyboardInterrupt(
            f"accel_ds_fix: save_state({target}) was interrupted (Ctrl-C) before it finished: nothing of it was "
            f"kept{_untouched(target)}."
        ) from exc
    except Exception as exc:
        if placed:
            raise
        free_now = shutil.disk_usage(os.path.dirname(os.path.abspath(target))).free
        written = _size(partial) if os.path.isdir(partial) else 0
        if not _ran_out_of_space(exc, free_now, written, needed):
            _discard(main, partial)
            raise
        _discard(main, partial)
        need = (f"about {_gib(needed)}" if needed and needed > written
                else f"more than the {_gib(written)} it had written")
        had = f"{_gib(free)} free when it started" if free is not None else "too little free"
        raise CheckpointError(
            f"accel_ds_fix: save_state({target}) ran out of disk space (the disk is full) after writing "
            f"{_gib(written)}: it needs {need} and the disk of {os.path.dirname(os.path.abspath(target))} had {had}. "
            f"Nothing of it was kept{_untouched(target)}. Free some space or save elsewhere."
        ) from exc
    return location


def _ran_out_of_space(exc, free_now, written, needed):
    """Whether a failed save failed for want of disk space. Python's writes say ENOSPC; torch.save's C++ writer
    says only "unexpected pos N vs M", "file write failed" or "iostream error" (a short write, errno lost): then the
    free space tells, now that the failed write has filled the disk."""
    if _disk_full(exc):
        return True
    text = " ".join(str(e) for e in _chain(exc))
    if not any(words in text for words in _TORCH_WRITE_FAILED):
        return False
    return free_now < (64 << 20) or (needed is not None and free_now + written < needed)


_TORCH_WRITE_FAILED = ("unexpected pos", "write failed", "PytorchStreamWriter failed writing", "iostream error")


def _chain(exc):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _untouched(target):
    return f"; the previous checkpoint at {target} is untouched" if os.path.isdir(target) else ""


def _discard(main, partial):
    if main and os.path.lexists(partial):
        shutil.rmtree(partial, ignore_errors=True)
