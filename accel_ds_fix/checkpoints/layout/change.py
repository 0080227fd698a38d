"""Resuming a merged engine's checkpoint under another DeepSpeed layout: another ZeRO stage, another number of
processes, the optimizer offloaded elsewhere (CPU, NVMe, none).

DeepSpeed 0.19.8 loads a checkpoint only into the layout that saved it (ZeRO-3 from a ZeRO-2 checkpoint: a bare
AssertionError; two processes from one: "not currently supported"). Its universal checkpoint format (one file
per parameter and state, whole tensors) loads into any of them. Here: the manifest records the layout a save was
made under (``of_engine``); load_state compares it with the engine's, refuses what cannot be converted (another
precision) before anything is loaded, and otherwise has the main process make the checkpoint's universal copy
beside it (universal_copy.py) while the others wait, and loads that with DeepSpeed's universal loading.

What DeepSpeed's loader leaves out, done here: loading into an NVMe-offloaded optimizer (DeepSpeed copies swap
files instead, and its universal loader cannot fill a sub group that is swapped out); Adam's step count in the
form the resumed optimizer keeps it (torch's Adam a tensor, DeepSpeedCPUAdam an int).
"""

import contextlib
import glob
import os

import torch

from ... import notices
from ...deepspeed_config import offload_device, section, zero_stage
from ...errors import CheckpointError
from ...nvme import sub_groups_in_ram
from ...processes import main_decides
from .. import crash_safe, manifest
from . import conversion_memory, universal_copy


def _device(offload):
    device = getattr(offload, "device", None) if offload is not None else None
    return str(getattr(device, "value", device) or "none")


def of_engine(engine):
    """The layout ``engine`` trains in, as the manifest records it."""
    import deepspeed

    zero = engine._config.zero_config
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    layout = {
        "zero_stage": int(engine.zero_optimization_stage()),
        "world_size": int(engine.dp_world_size),
        "offload_optimizer": _device(zero.offload_optimizer),
        "offload_param": _device(zero.offload_param),
        "precision": precision,
        "deepspeed": deepspeed.__version__,
    }
    kept = sub_groups_in_ram.kept_sub_groups(engine.optimizer)
    if kept:  # NVMe: these sub groups are in the ZeRO checkpoint file, the others in swap files
        layout["nvme_sub_groups_in_ram"] = kept
    return layout


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
        enabled = {key: section(config, key).get("enabled", False) for key in ("bf16", "fp16")}
        if not all(isinstance(value, bool) for value in enabled.values()):
            return None  # "auto" left in: the precision cannot be told
        precision = "bf16" if enabled["bf16"] else "fp16" if enabled["fp16"] else "fp32"
        return {"zero_stage": zero_stage(config), "world_size": int(states["dp_world_size"]),
                "offload_optimizer": offload_device(config, "offload_optimizer"),
                "offload_param": offload_device(config, "offload_param"),
                "precision": precision, "deepspeed": str(states.get("ds_version"))}
    except Exception:  # noqa: BLE001 - an unreadable or unexpected file: DeepSpeed's own load says what is wrong
        return None


def describe(layout):
    processes = f"{layout['world_size']} process" + ("es" if layout["world_size"] != 1 else "")
    where = {"none": "", "cpu": ", optimizer on the CPU", "nvme": ", optimizer on NVMe"}[layout["offload_optimizer"]]
    if layout.get("offload_param", "none") != "none":
        where += f", weights on {'the CPU' if layout['offload_param'] == 'cpu' else 'NVMe'}"
    if layout.get("nvme_sub_groups_in_ram"):
        where += f" ({len(layout['nvme_sub_groups_in_ram'])} sub group(s) of it in RAM)"
    return f"ZeRO-{layout['zero_stage']}, {processes}{where}, {layout['precision']}"


def _needs_conversion(saved, current):
    """Whether DeepSpeed's own load cannot take the checkpoint: the optimizer states are partitioned otherwise
    (stage, processes) or kept elsewhere (NVMe swap files on one side only, or of other sub groups). CPU offload
    or none, and where the weights are offloaded, store the same files."""
    nvme = saved["offload_optimizer"] == "nvme", current["offload_optimizer"] == "nvme"
    in_ram = saved.get("nvme_sub_groups_in_ram", []), current.get("nvme_sub_groups_in_ram", [])
    return (saved["zero_stage"] != current["zero_stage"] or saved["world_size"] != current["world_size"]
            or nvme[0] != nvme[1] or (all(nvme) and in_ram[0] != in_ram[1]))


def check(directory, saved, current):
    """Raise CheckpointError, before anything is loaded, where the checkpoint cannot be resumed in ``current``;
    return True where it must be converted first."""
    if saved is None or not _needs_conversion(saved, current) and saved["precision"] == current["precision"]:
        return False
    differs = [f"{key.replace('_', ' ')} {saved.get(key, [])} -> {current.get(key, [])}" for key in
               ("zero_stage", "world_size", "offload_optimizer", "nvme_sub_groups_in_ram", "precision")
               if saved.get(key, []) != current.get(key, [])]
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


def copy_for_all(accelerator, verified, tag, for_what):
    """The checkpoint's universal copy, made by the main process while the others wait, or reused where a whole one
    of this checkpoint is there: ("reused", 0.0) or ("converted", seconds) on every process, an error on all of
    them (not a hang of the others)."""
    directory = verified.path
    folder = universal_copy.converted_path(directory)

    def convert():
        if universal_copy.reusable(folder, verified.digest, tag):
            return "reused", 0.0
        conversion_memory.check(directory, tag, in_run=True)
        return "converted", universal_copy.convert(directory, tag, verified.digest)

    return main_decides.on_main_for_all(accelerator, convert, lambda exc: CheckpointError(
        f"accel_ds_fix: converting {directory} for {for_what} failed: {type(exc).__name__}: {exc}. Nothing was "
        "loaded; the checkpoint is unchanged."))


def _prepared(accelerator, verified, tag, saved, current):
    """The universal copy, converted by the main process while the others wait; every process gets the same
    outcome (an error raised on all of them, not a hang)."""
    directory = verified.path
    folder = universal_copy.converted_path(directory)
    kind, value = copy_for_all(accelerator, verified, tag, describe(current))
    if not accelerator.is_main_process:
        return folder  # said once, by the process that converted
    if kind == "converted":
        notices.say(f"{directory} was saved under {describe(saved)}; this run is {describe(current)}: converted it "
                    f"to DeepSpeed's universal checkpoint format in {value:.1f} s into {folder} "
                    f"({universal_copy.size(folder) / 2**20:.1f} MiB, the original unchanged) and resumed from that")
    else:
        notices.say(f"{directory} was saved under {describe(saved)}; this run is {describe(current)}: resumed from "
                    f"its universal copy {folder}, converted before")
    return folder


def convert_ahead(directory, tag="pytorch_model"):
    """`python -m accel_ds_fix convert-checkpoint DIR`: the universal copy made before the run that resumes it (the
    converter holds one process's optimizer states in host memory, which a run short of RAM has not to spare:
    conversion_memory.py). Returns (folder, seconds, reused)."""
    verified = crash_safe.check_whole(directory)
    if verified is None or verified.content is None:
        raise CheckpointError(f"accel_ds_fix: {directory} has no {manifest.FILENAME}: it was not saved by "
                              "accelerator.save_state() with models merged by accel_ds_fix; nothing to convert.")
    if not os.path.isdir(os.path.join(directory, tag)):
        raise CheckpointError(f"accel_ds_fix: {directory} has no DeepSpeed checkpoint {tag}/ (give --tag: the "
                              "engine's folder inside it); nothing was written.")
    if universal_copy.reusable(universal_copy.converted_path(directory), verified.digest, tag):
        return universal_copy.converted_path(directory), 0.0, True
    conversion_memory.check(directory, tag, in_run=False)
    return universal_copy.converted_path(directory), universal_copy.convert(directory, tag, verified.digest), False


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
def resumed(accelerator, engine, verified, tag, saved_layout):
    """Around accelerate's load_state of the checkpoint crash_safe.check_whole ``verified``: yields False where
    it loads as it is, True where it is loaded from its universal copy (converted here first where needed)."""
    current = of_engine(engine)
    if not check(verified.path, saved_layout, current):
        yield False
        return
    folder = _prepared(accelerator, verified, tag, saved_layout, current)
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


def refuse_several_engines(directory, saved, current, tags):
    """A checkpoint of one engine per optimizer (two optimizers in one prepare()) resumes in the layout that saved
    it only: converting several engines' checkpoints is not built."""
    raise CheckpointError(
        f"accel_ds_fix: cannot resume from {directory} in this layout: it holds {len(tags)} DeepSpeed engines (one "
        f"per optimizer: {', '.join(tags)}) saved under {describe(saved)}, and this run is {describe(current)}. A "
        f"checkpoint of several engines resumes in the layout that saved it only. Nothing was loaded. Resume with "
        f"that layout, or export the weights (accelerator.save_model) and start new optimizers from them."
    )
