"""The universal copy of a merged engine's checkpoint: DeepSpeed's universal checkpoint format (one folder per
parameter, whole fp32 weights and Adam states), written once beside the checkpoint as
``.accel_ds_fix-universal.<folder>`` for a resume under another layout (layout_change.py).

The copy is made in ``.accel_ds_fix-converting.<folder>`` and renamed when whole, with a record of the checkpoint it
was made from (its manifest's sha256, which covers every file) written last: a half-written copy is never taken,
and one of other content is made again. The original checkpoint is never changed.

What DeepSpeed 0.19.8's converter (``deepspeed.checkpoint.ds_to_universal``) leaves out, done here: the sub groups
an NVMe checkpoint holds in swap files (put back into its optimizer files first); what its ZeRO-1/2 and ZeRO-3
universal loaders each expect and it writes for one only (the model-states file names, the optimizer's global
state, Adam's step count in every parameter's folder, shaped tensors).
"""

import argparse
import contextlib
import glob
import io
import json
import os
import re
import shutil
import time

import torch

from ...errors import CheckpointError

UNIVERSAL = ".accel_ds_fix-universal."
CONVERTING = ".accel_ds_fix-converting."
RECORD = "accel_ds_fix-conversion.json"  # written last: the conversion is whole, and of which checkpoint


def _beside(directory, prefix):
    directory = os.path.normpath(os.path.abspath(directory))
    return os.path.join(os.path.dirname(directory), prefix + os.path.basename(directory))


def converted_path(directory):
    return _beside(directory, UNIVERSAL)


def reusable(folder, digest, tag):
    try:
        with open(os.path.join(folder, RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    return record.get("source") == digest and record.get("tag") == tag


def swap_files(rank_dir):
    """{sub group ds_id "first_last": {"fp32" | state name: path}} of one rank's NVMe swap files."""
    found = {}
    for path in glob.glob(os.path.join(rank_dir, "*.tensor.swp")):
        name = os.path.basename(path)[: -len(".tensor.swp")]
        state, _, ds_id = name.rpartition("-")
        if "gradient" in name or not re.fullmatch(r"\d+_\d+", ds_id):
            continue
        found.setdefault(ds_id, {})[state or "fp32"] = path
    return found


def rank_swap_files(tag_dir, rank):
    """swap_files of one process's folder in an NVMe checkpoint's ``offloaded_tensors``."""
    return swap_files(os.path.join(tag_dir, "offloaded_tensors", f"rank{rank:02d}"))


def optimizer_files(tag_dir):
    """{rank: path} of a DeepSpeed checkpoint's per-process optimizer states files."""
    return {int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path)).group(1)): path
            for path in glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*_optim_states.pt"))}


def read_swap_file(path, numel):
    """The first ``numel`` fp32 values of an NVMe swap file (DeepSpeed pads it to its I/O alignment)."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=torch.float32)[:numel].clone()


def _partition_numel(shapes, world):
    return sum(-(-int(torch.Size(shape).numel()) // world) for shape in shapes.values())


def _fill_swapped(source_tag, staged_tag):
    """An NVMe checkpoint's ZeRO-3 optimizer files with the swapped-out sub groups put back from the swap files
    in ``offloaded_tensors/rankNN`` (the form DeepSpeed's converter reads), written into ``staged_tag``; the
    other files are linked. Sub groups and swap files pair in the order of their first parameter id."""
    os.makedirs(staged_tag)
    for name in os.listdir(source_tag):
        path = os.path.join(source_tag, name)
        if os.path.isfile(path) and not name.endswith("_optim_states.pt"):
            os.link(path, os.path.join(staged_tag, name))
    model_file = sorted(glob.glob(os.path.join(source_tag, "zero_pp_rank_0_mp_rank_*_model_states.pt")))[0]
    shapes = torch.load(model_file, map_location="cpu", weights_only=False)["param_shapes"]
    optim_files = optimizer_files(source_tag)
    world = len(optim_files)
    for rank, path in sorted(optim_files.items()):
        saved = torch.load(path, map_location="cpu", weights_only=False)
        optim = saved["optimizer_state_dict"]
        flat, states = optim["fp32_flat_groups"], optim["optimizer_state_dict"]["state"]
        swapped = [i for i, t in enumerate(flat) if t.numel() == 0 and _partition_numel(shapes[i], world) > 0]
        files = rank_swap_files(source_tag, rank)
        ids = sorted(files, key=lambda ds_id: int(ds_id.split("_")[0]))
        if len(ids) != len(swapped):
            raise CheckpointError(
                f"accel_ds_fix: cannot convert {source_tag}: rank {rank} has {len(swapped)} sub group(s) swapped to "
                f"NVMe but {len(ids)} set(s) of swap files in offloaded_tensors/rank{rank:02d}. Nothing was loaded; "
                "resume it under the layout that saved it."
            )
        step = next((s["step"] for s in states.values() if "step" in s), None)
        for index, ds_id in zip(swapped, ids):
            numel = _partition_numel(shapes[index], world)
            flat[index] = read_swap_file(files[ds_id]["fp32"], numel)
            state = states.setdefault(index, {})
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = read_swap_file(files[ds_id][key], numel)
            if "step" not in state and step is not None:
                state["step"] = step
        torch.save(saved, os.path.join(staged_tag, os.path.basename(path)))


def _run_converter(source_tag, output_tag):
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=source_tag, output_folder=output_tag, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            ds_to_universal.main(args)
    except Exception as exc:
        raise CheckpointError(
            f"accel_ds_fix: DeepSpeed's universal checkpoint converter failed on {source_tag}: "
            f"{type(exc).__name__}: {exc}. Nothing was loaded; resume it under the layout that saved it, or export "
            f"the weights and start a new optimizer. The converter said: {said.getvalue()[-1500:]}"
        ) from exc


def _complete(output_tag):
    """What DeepSpeed's ZeRO-1/2 and ZeRO-3 universal loaders each expect and its converter writes for one only:
    the model-states file under both names, the optimizer's global state in both forms, and Adam's step count
    in every parameter's folder."""
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    present = [n for n in names if os.path.isfile(os.path.join(output_tag, n))]
    for name in names:
        if name not in present:
            os.link(os.path.join(output_tag, present[0]), os.path.join(output_tag, name))
    zero = os.path.join(output_tag, "zero")
    state_path = os.path.join(zero, "optimizer_state.pt")
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    state.pop("fp32_flat_groups", None)  # ZeRO-3's whole master weights: each parameter's folder has them
    inner = state.get("optimizer_state_dict")
    groups = state.get("param_groups") or inner["param_groups"]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    step = None
    if inner is not None:
        step = next((s["step"] for s in inner.get("state", {}).values() if "step" in s), None)
    params = [p for p in sorted(os.listdir(zero)) if os.path.isdir(os.path.join(zero, p))]
    if step is None:
        found = [os.path.join(zero, p, "step.pt") for p in params if os.path.isfile(os.path.join(zero, p, "step.pt"))]
        step = torch.load(found[0], weights_only=False) if found else None
    model_states = torch.load(os.path.join(output_tag, names[0]), map_location="cpu", weights_only=False)
    shapes = {name: shape for group in model_states["param_shapes"] for name, shape in group.items()}
    for p in params:
        path = os.path.join(zero, p, "step.pt")
        if step is not None and not os.path.isfile(path):
            torch.save(step, path)
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            path = os.path.join(zero, p, f"{key}.pt")
            if not os.path.isfile(path):
                continue  # a frozen parameter: the converter wrote its weight only
            saved = torch.load(path, map_location="cpu", weights_only=False)
            if torch.is_tensor(saved):  # ZeRO-3's converter: flat; the ZeRO-1/2 loader wants it shaped, in a dict
                torch.save({"param": saved.view(shapes[p]), "cat_dim": 0}, path)
    import deepspeed

    state["param_groups"] = groups
    state["optimizer_state_dict"] = {"state": {0: {"step": step}} if step is not None else {}, "param_groups": groups}
    state.setdefault("ds_version", deepspeed.__version__)
    torch.save(state, state_path)


def _orphans(directory):
    """Universal copies beside ``directory`` whose checkpoint is gone (deleted by a save's total_limit)."""
    parent = os.path.dirname(os.path.normpath(os.path.abspath(directory)))
    return [os.path.join(parent, name) for name in os.listdir(parent) if name.startswith(UNIVERSAL)
            and not os.path.isdir(os.path.join(parent, name[len(UNIVERSAL):]))]


def convert(directory, tag, digest):
    """Write the universal copy of ``directory`` (tag ``tag``) beside it; return how many seconds it took."""
    final, work = converted_path(directory), _beside(directory, CONVERTING)
    started = time.monotonic()
    for leftover in (work, final, *_orphans(directory)):
        if os.path.lexists(leftover):
            # a conversion killed half-way, one of an earlier checkpoint there or one gone; its record goes first,
            # so that a kill during the removal leaves nothing that reads as whole
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.remove(os.path.join(leftover, RECORD))
            shutil.rmtree(leftover)
    os.makedirs(work)
    try:
        source_tag = os.path.join(directory, tag)
        if os.path.isdir(os.path.join(source_tag, "offloaded_tensors")):
            staged = os.path.join(work, "nvme-filled", tag)
            _fill_swapped(source_tag, staged)
            source_tag = staged
        output_tag = os.path.join(work, tag)
        _run_converter(source_tag, output_tag)
        shutil.rmtree(os.path.join(work, "nvme-filled"), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(work, "latest_universal"))  # the converter's; the load names the tag itself
        _complete(output_tag)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # a failed or interrupted conversion leaves nothing half-written
        raise
    seconds = time.monotonic() - started
    record = {"source": digest, "tag": tag, "seconds": round(seconds, 3)}
    with open(os.path.join(work, RECORD), "w", encoding="utf-8") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(work, final)
    return seconds


def size(folder):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)
