"""What a merged checkpoint holds, written beside DeepSpeed's files by save_state and checked by load_state
before anything is loaded: resuming with another set of models fails with the difference, not a partial load."""

import json
import os
import re

from ..errors import MergeError
from ..merge.trainability import frozen_names

FILENAME = "accel_ds_fix.json"
# 2 added "frozen": the parameters DeepSpeed stored as frozen; 3 "files" (checkpoints/crash_safe.py) and "kept";
# 4 "layout": the DeepSpeed layout it was saved under (checkpoints/layout/change.py)
FORMAT = 4


def _shape(param):
    return list(getattr(param, "ds_shape", None) or param.shape)  # ZeRO-3 keeps the full shape in ds_shape


def describe(merged):
    """{name: {"class": ..., "parameters": {param name: shape}}} of a MergedModels module."""
    return {
        name: {
            "class": type(model).__name__,
            "parameters": {n: _shape(p) for n, p in model.named_parameters()},
        }
        for name, model in merged.models.items()
    }


def write(directory, merged, files, kept=(), layout=None):
    """Written last by a save: ``files`` {relative path: {"size", "sha256"}} is every file of the checkpoint;
    ``kept`` the top-level entries of the script's own that the save found in the folder and left there;
    ``layout`` the DeepSpeed layout it was saved under (checkpoints/layout/change.py)."""
    content = {"format": FORMAT, "models": describe(merged), "frozen": frozen_names(merged), "files": files,
               "kept": list(kept)}
    if hasattr(merged, "engines"):  # one engine per optimizer: which DeepSpeed checkpoint holds which models
        content["engines"] = merged.engines
    if layout is not None:
        content["layout"] = layout
    with open(os.path.join(directory, FILENAME), "w", encoding="utf-8") as f:
        json.dump(content, f)
        f.flush()
        os.fsync(f.fileno())


def read(directory):
    """The manifest's content, None where there is none; ValueError where it is not whole JSON."""
    raw = read_bytes(directory)
    return None if raw is None else json.loads(raw)


def read_bytes(directory):
    """The manifest file as written, None where there is none."""
    path = os.path.join(directory, FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def _summary(models):
    return ", ".join(f"{name} ({info['class']})" for name, info in models.items()) or "none"


def check(verified, merged):
    """Raise MergeError unless the checkpoint that crash_safe.check_whole ``verified`` was saved from a merged
    engine of the same models; else return what the manifest says (``frozen`` is None for a checkpoint of format
    1)."""
    directory, content = verified.path, verified.content
    current = describe(merged)
    if content is None:
        raise MergeError(
            f"accel_ds_fix: {directory} has no {FILENAME}, so it was not saved by accelerator.save_state() from "
            f"models merged by accel_ds_fix. This run merged {_summary(current)}; resume from a checkpoint this "
            "run's script saved with accel_ds_fix active, or start from exported weights."
        )
    saved = content["models"]
    problems = []
    missing, extra = sorted(set(saved) - set(current)), sorted(set(current) - set(saved))
    if missing:
        problems.append("in the checkpoint but not passed to prepare() now: " + _summary({n: saved[n] for n in missing}))
    if extra:
        problems.append("passed to prepare() now but not in the checkpoint: " + _summary({n: current[n] for n in extra}))
    for name in sorted(set(saved) & set(current)):
        before, now = saved[name]["parameters"], current[name]["parameters"]
        changed = [n for n in sorted(set(before) | set(now)) if before.get(n) != now.get(n)]
        if changed:
            shown = "; ".join(f"{n}: {before.get(n, 'absent')} -> {now.get(n, 'absent')}" for n in changed[:5])
            problems.append(
                f"{name} ({current[name]['class']}) has {len(changed)} parameter(s) of other names or shapes ({shown})"
            )
    if problems:
        raise MergeError(
            f"accel_ds_fix: cannot resume from {directory}: it holds {_summary(saved)}, but this run merged "
            f"{_summary(current)}. " + "; ".join(problems) + ". Nothing was loaded. Pass the same models, in the "
            "same order, to accelerator.prepare() as the run that saved it."
        )
    return {"frozen": content.get("frozen"), "layout": content.get("layout")}


def automatic_checkpoint(project_dir):
    """The folder accelerate's load_state(None) picks with automatic checkpoint naming: the highest number."""
    root = os.path.join(project_dir, "checkpoints")
    # a save's temporary folders (checkpoints/crash_safe.py) are no checkpoints
    folders = [os.path.join(root, f) for f in os.listdir(root) if not f.startswith(".accel_ds_fix-")]
    folders.sort(key=lambda folder: [int(x) for x in re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)][:1])
    return folders[-1] if folders else None
