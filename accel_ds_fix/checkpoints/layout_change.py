"""Resuming a merged engine's checkpoint under another DeepSpeed layout: another ZeRO stage, another number of
processes, the optimizer offloaded elsewhere (CPU, NVMe, none).

DeepSpeed 0.19.8 loads a checkpoint only into the layout that saved it (ZeRO-3 from a ZeRO-2 checkpoint: a bare
AssertionError; two processes from one: "not currently supported"). Its universal checkpoint format (one file
per parameter and state, whole tensors) loads into any of them. Here: the manifest records the layout a save was
made under (``of_engine``); load_state compares it with the engine's, refuses what cannot be converted (another
precision) before anything is loaded, and otherwise converts the checkpoint once into
``.accel_ds_fix-universal.<folder>`` beside it (the original is never changed; written under a temporary name
and renamed when whole; reused while the checkpoint is the same) and loads that.

What DeepSpeed's converter and loader leave out, done here: the swapped-out sub groups of an NVMe checkpoint
(their fp32 weights and Adam states are in the swap files, not in the optimizer state file); Adam's step count
between stages (ZeRO-3 keeps it in the optimizer's state, ZeRO-1/2 in each parameter's folder); loading into an
NVMe-offloaded optimizer (DeepSpeed copies swap files instead, and its universal loader cannot fill a sub group
that is swapped out).
"""

import argparse
import contextlib
import glob
import hashlib
import io
import json
import os
import re
import shutil
import time

import torch

from .. import notices
from ..errors import CheckpointError
from . import manifest

UNIVERSAL = ".accel_ds_fix-universal."
CONVERTING = ".accel_ds_fix-converting."
RECORD = "accel_ds_fix-conversion.json"  # written last: the conversion is whole, and of which checkpoint


def is_conversion(name):
    return name.startswith((UNIVERSAL, CONVERTING))


def _device(offload):
    device = getattr(offload, "device", None) if offload is not None else None
    return str(getattr(device, "value", device) or "none")


def of_engine(engine):
    """The layout ``engine`` trains in, as the manifest records it."""
    import deepspeed

    zero = engine._config.zero_config
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    return {
        "zero_stage": int(engine.zero_optimization_stage()),
        "world_size": int(engine.dp_world_size),
        "offload_optimizer": _device(zero.offload_optimizer),
        "offload_param": _device(zero.offload_param),
        "precision": precision,
        "deepspeed": deepspeed.__version__,
    }


def of_checkpoint(directory, tag, recorded):
    """The layout a checkpoint was saved under: as its manifest records it, else (saved before the manifest had
    it) as DeepSpeed's model-states file says (its config and process count); None where neither tells."""
    if recorded is not None:
        return recorded
    names = sorted(glob.glob(os.path.join(directory, tag, "*mp_rank_00_model_states.pt")))
    if not names:
        return None
    try:  # mmap: the file holds the ZeRO-1/2 weights too
        states = torch.load(names[0], map_location="cpu", weights_only=False, mmap=True)
        config = states["ds_config"]
        zero = config.get("zero_optimization", {})
        enabled = {key: (config.get(key) or {}).get("enabled", False) for key in ("bf16", "fp16")}
        if not all(isinstance(value, bool) for value in enabled.values()):
            return None  # "auto" left in: the precision cannot be told
        precision = "bf16" if enabled["bf16"] else "fp16" if enabled["fp16"] else "fp32"
        return {"zero_stage": int(zero.get("stage", 0)), "world_size": int(states["dp_world_size"]),
                "offload_optimizer": str((zero.get("offload_optimizer") or {}).get("device") or "none"),
                "offload_param": str((zero.get("offload_param") or {}).get("device") or "none"),
                "precision": precision, "deepspeed": str(states.get("ds_version"))}
    except Exception:  # noqa: BLE001 - an unreadable or unexpected file: DeepSpeed's own load says what is wrong
        return None


def describe(layout):
    processes = f"{layout['world_size']} process" + ("es" if layout["world_size"] != 1 else "")
    where = {"none": "", "cpu": ", optimizer on the CPU", "nvme": ", optimizer on NVMe"}[layout["offload_optimizer"]]
    if layout.get("offload_param", "none") != "none":
        where += f", weights on {'the CPU' if layout['offload_param'] == 'cpu' else 'NVMe'}"
    return f"ZeRO-{layout['zero_stage']}, {processes}{where}, {layout['precision']}"


def _needs_conversion(saved, current):
    """Whether DeepSpeed's own load cannot take the checkpoint: the optimizer states are partitioned otherwise
    (stage, processes) or kept elsewhere (NVMe swap files on one side only). CPU offload or none, and where the
    weights are offloaded, store the same files."""
    return (saved["zero_stage"] != current["zero_stage"] or saved["world_size"] != current["world_size"]
            or (saved["offload_optimizer"] == "nvme") != (current["offload_optimizer"] == "nvme"))


def check(directory, saved, current):
    """Raise CheckpointError, before anything is loaded, where the checkpoint cannot be resumed in ``current``;
    return True where it must be converted first."""
    if saved is None or not _needs_conversion(saved, current) and saved["precision"] == current["precision"]:
        return False
    differs = [f"{key.replace('_', ' ')} {saved[key]} -> {current[key]}" for key in
               ("zero_stage", "world_size", "offload_optimizer", "precision") if saved[key] != current[key]]
    head = (f"accel_ds_fix: cannot resume from {directory} in this layout: it was saved under "
            f"{describe(saved)}, this run is {describe(current)} ({'; '.join(differs)}).")
    if saved["precision"] != current["precision"]:
        raise CheckpointError(
            f"{head} Layouts convert within one precision only: DeepSpeed's {saved['precision']} optimizer wrote "
            f"these states (bf16's in files of their own, fp16's with its loss scale), and its "
            f"{current['precision']} optimizer does not load them. Nothing was loaded. Resume with --mixed_precision "
            f"{saved['precision']}, or export the weights (accelerator.save_model, or zero_to_fp32.py in the "
            f"checkpoint) and start a new optimizer from them under {current['precision']}."
        )
    for layout in (saved, current):
        if layout["zero_stage"] not in (1, 2, 3):
            raise CheckpointError(
                f"{head} DeepSpeed converts between ZeRO stages 1, 2 and 3 only. Nothing was loaded. Resume with "
                f"the layout that saved it, or export the weights and start a new optimizer."
            )
    return True


# ---- the conversion, on one process --------------------------------------------------------------------------


def _source_digest(directory):
    # The manifest lists every file's sha256 (crash_safe.py): its own digest names the checkpoint's content.
    with open(os.path.join(directory, manifest.FILENAME), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _beside(directory, prefix):
    directory = os.path.normpath(os.path.abspath(directory))
    return os.path.join(os.path.dirname(directory), prefix + os.path.basename(directory))


def converted_path(directory):
    return _beside(directory, UNIVERSAL)


def _reusable(folder, digest, tag):
    try:
        with open(os.path.join(folder, RECORD), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    return record.get("source") == digest and record.get("tag") == tag


def _swap_files(rank_dir):
    """{sub group ds_id "first_last": {"fp32" | state name: path}} of one rank's NVMe swap files."""
    found = {}
    for path in glob.glob(os.path.join(rank_dir, "*.tensor.swp")):
        name = os.path.basename(path)[: -len(".tensor.swp")]
        state, _, ds_id = name.rpartition("-")
        if "gradient" in name or not re.fullmatch(r"\d+_\d+", ds_id):
            continue
        found.setdefault(ds_id, {})[state or "fp32"] = path
    return found


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
    optim_files = sorted(glob.glob(os.path.join(source_tag, "*zero_pp_rank_*_optim_states.pt")))
    world = len(optim_files)
    for path in optim_files:
        rank = int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(path)).group(1))
        saved = torch.load(path, map_location="cpu", weights_only=False)
        optim = saved["optimizer_state_dict"]
        flat, states = optim["fp32_flat_groups"], optim["optimizer_state_dict"]["state"]
        swapped = [i for i, t in enumerate(flat) if t.numel() == 0 and _partition_numel(shapes[i], world) > 0]
        files = _swap_files(os.path.join(source_tag, "offloaded_tensors", f"rank{rank:02d}"))
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

            def read(key, numel=numel, ds_id=ds_id):
                with open(files[ds_id][key], "rb") as f:
                    data = bytearray(f.read())
                return torch.frombuffer(data, dtype=torch.float32)[:numel].clone()

            flat[index] = read("fp32")
            state = states.setdefault(index, {})
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = read(key)
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


def _convert(directory, tag, digest):
    """Write the universal copy of ``directory`` (tag ``tag``) beside it; return how many seconds it took."""
    final, work = converted_path(directory), _beside(directory, CONVERTING)
    started = time.monotonic()
    for leftover in (work, final, *_orphans(directory)):
        if os.path.lexists(leftover):
            shutil.rmtree(leftover)  # a conversion killed half-way, one of an earlier checkpoint there or one gone
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


def _size(folder):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)


def _prepared(accelerator, directory, tag, saved, current):
    """The universal copy, converted by the main process while the others wait; every process gets the same
    outcome (an error raised on all of them, not a hang)."""
    folder = converted_path(directory)
    outcome = None
    if accelerator.is_main_process:
        try:
            digest = _source_digest(directory)
            if _reusable(folder, digest, tag):
                outcome = ("reused", 0.0)
            else:
                outcome = ("converted", _convert(directory, tag, digest))
        except Exception as exc:  # noqa: BLE001 - handed to every process below
            outcome = ("error", exc if isinstance(exc, CheckpointError) else CheckpointError(
                f"accel_ds_fix: converting {directory} for {describe(current)} failed: {type(exc).__name__}: {exc}. "
                "Nothing was loaded; the checkpoint is unchanged."))
    if accelerator.num_processes > 1:
        box = [outcome]
        torch.distributed.broadcast_object_list(box, src=0)
        outcome = box[0]
    kind, value = outcome
    if kind == "error":
        raise value
    if not accelerator.is_main_process:
        return folder  # said once, by the process that converted
    if kind == "converted":
        notices.say(f"{directory} was saved under {describe(saved)}; this run is {describe(current)}: converted it "
                    f"to DeepSpeed's universal checkpoint format in {value:.1f} s into {folder} "
                    f"({_size(folder) / 2**20:.1f} MiB, the original unchanged) and resumed from that")
    else:
        notices.say(f"{directory} was saved under {describe(saved)}; this run is {describe(current)}: resumed from "
                    f"its universal copy {folder}, converted before")
    return folder


def convert_ahead(directory, tag="pytorch_model"):
    """`python -m accel_ds_fix convert-checkpoint DIR`: the universal copy made before the run that resumes it (the
    converter holds one rank's optimizer states file in host memory, which a run short of RAM has not to spare).
    Returns (folder, seconds, reused)."""
    from . import crash_safe

    crash_safe.check_whole(directory)
    if manifest.read(directory) is None:
        raise CheckpointError(f"accel_ds_fix: {directory} has no {manifest.FILENAME}: it was not saved by "
                              "accelerator.save_state() with models merged by accel_ds_fix; nothing to convert.")
    if not os.path.isdir(os.path.join(directory, tag)):
        raise CheckpointError(f"accel_ds_fix: {directory} has no DeepSpeed checkpoint {tag}/ (give --tag: the "
                              "engine's folder inside it); nothing was written.")
    digest = _source_digest(directory)
    if _reusable(converted_path(directory), digest, tag):
        return converted_path(directory), 0.0, True
    return converted_path(directory), _convert(directory, tag, digest), False


# ---- the load ---------------------------------------------------------------------------------------------------


def _load_into_nvme_optimizer(optimizer, checkpoint_folder):
    """DeepSpeed's ZeRO-3 universal load, one sub group at a time swapped in, filled and swapped out again (its
    own loader writes into the swapped-out, empty buffers)."""
    zero = os.path.join(checkpoint_folder, "zero")
    optim_sd = torch.load(os.path.join(zero, "optimizer_state.pt"), weights_only=False)
    optimizer._load_global_state_stage3(optim_sd)
    step = optim_sd["optimizer_state_dict"]["state"][0]["step"]
    timers = set()
    for sub_group, params in enumerate(optimizer.fp16_groups):
        optimizer._prepare_sub_group(sub_group, timers)
        fp32 = optimizer.fp32_partitioned_groups_flat[sub_group]
        state = optimizer.optimizer.state[fp32]
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            target = fp32.data if key == "fp32" else state.setdefault(key, torch.zeros_like(fp32.data))
            offset = 0
            for param in params:
                part = optimizer.load_hp_checkpoint_state(os.path.join(zero, optimizer.param_names[param]), key,
                                                          param=param)
                target.narrow(0, offset, part.numel()).copy_(part)
                offset += part.numel()
        state["step"] = step
        optimizer._reassign_or_swap_out_partitioned_parameters(sub_group)
        optimizer._release_sub_group(sub_group, timers)
    for group in optimizer.optimizer.param_groups:
        group.update({k: v for k, v in optim_sd["param_groups"][0].items() if k != "params"})


@contextlib.contextmanager
def _universal_load(engine, folder):
    """While accelerate's load_state runs: the engine's load_checkpoint reads ``folder`` (same tag) with
    DeepSpeed's universal loading."""
    original = engine.load_checkpoint
    config = engine._config

    def load_checkpoint(load_dir, tag=None, **kwargs):
        if not engine.zero_nvme_offload_optimizer():
            return original(folder, tag, **kwargs)
        # DeepSpeed skips its ZeRO load under NVMe offload and copies swap files the copy has none of.
        engine.zero_nvme_offload_optimizer = lambda: False
        engine._load_zero_checkpoint = lambda load_dir, tag, load_optimizer_states=True: (
            _load_into_nvme_optimizer(engine.optimizer, os.path.join(load_dir, str(tag))) or True)
        try:
            return original(folder, tag, **kwargs)
        finally:
            del engine.zero_nvme_offload_optimizer, engine._load_zero_checkpoint

    was = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    engine.load_checkpoint = load_checkpoint
    try:
        yield
    finally:
        config.load_universal_checkpoint = was
        del engine.load_checkpoint


@contextlib.contextmanager
def resumed(accelerator, engine, directory, tag, saved_layout):
    """Around accelerate's load_state: yields False where the checkpoint loads as it is, True where it is
    loaded from its universal copy (converted here first where needed)."""
    current = of_engine(engine)
    if not check(directory, saved_layout, current):
        yield False
        return
    folder = _prepared(accelerator, directory, tag, saved_layout, current)
    with _universal_load(engine, folder):
        yield True
    _steps_as_kept(engine.optimizer.optimizer)


def _steps_as_kept(base):
    """Adam's step count in the form the resumed optimizer keeps it: torch's Adam a tensor, DeepSpeed's CPU Adam
    an int (the checkpoint's optimizer may have been the other one: CPU offload on one side only)."""
    as_tensor = type(base).__module__.startswith("torch.optim")
    for state in base.state.values():
        step = state.get("step")
        if step is None:
            continue
        value = float(step.item() if torch.is_tensor(step) else step)
        state["step"] = torch.tensor(value, dtype=torch.float32) if as_tensor else int(value)
