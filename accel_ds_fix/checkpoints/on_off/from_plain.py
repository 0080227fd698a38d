"""A checkpoint that plain accelerate's save_state wrote (one weights file per model, ``optimizer.bin``,
``scheduler.bin``, ``random_states_*.pkl``), loaded by the same script under DeepSpeed with merged models: a run
begun at home on one card goes on on a rented multi-GPU machine.

Under DeepSpeed accelerate loads a DeepSpeed checkpoint, which this folder is not, and the package's load_state
refused it for want of a manifest. Here the plain files are written as DeepSpeed's universal checkpoint (whole fp32
weights and Adam states, one folder per parameter: the format layout/universal_copy.py makes from DeepSpeed's own
checkpoints) beside the folder, and DeepSpeed's universal loading partitions them into the engine whatever its
ZeRO stage, process count or offload. The script's optimizer states are matched to the engine's parameters in the
order the script built its optimizer, which DeepSpeed keeps. Frozen weights and buffers, which the universal
loading leaves as built, are copied into the models from the plain files. accelerate's own load then restores the
scheduler, the random states and the custom objects from the folder itself.
"""

import hashlib
import json
import logging
import os
import shutil

import torch

from ... import notices
from ...errors import CheckpointError
from ...lookup import engine_record
from ...processes import main_decides
from ...zero3.loading import models_built_whole
from .. import cpu_adam_steps, load_hooks, param_groups
from ..layout import change as layout_change
from ..layout import universal_copy
from . import plain_files


def _refuse(directory, why, fix):
    raise CheckpointError(f"accel_ds_fix: cannot load {directory} under DeepSpeed: {why}. Nothing was loaded. {fix}")


def _shape(param):
    return tuple(getattr(param, "ds_shape", None) or param.shape)


def _script_order(engine):
    """The trained parameters in each group of the script's optimizer, in the script's order (the order of a plain
    ``optimizer.bin``), as DeepSpeed's ZeRO optimizer keeps them."""
    zero = engine.optimizer
    groups = len(param_groups._base(engine).param_groups)
    if hasattr(zero, "bit16_groups"):  # ZeRO-1/2
        return [list(group) for group in zero.bit16_groups]
    order = [[] for _ in range(groups)]  # ZeRO-3: per source group, split by process group
    for group in zero.trainable_param_groups:
        order[group["_ds_source_param_group_id"]].extend(group["params"])
    return order


def _read(accelerator, engine, directory):
    """Everything taken from the plain files, checked against the engine before anything changes: (each model's
    state dict or None, the optimizer's state dict or None, the engine's parameters in the script's order)."""
    models = engine.module.models
    if accelerator._models != [engine]:
        _refuse(directory, f"this run prepared {len(accelerator._models)} models or engines beside the merged one",
                "Prepare the models in one accelerator.prepare() call, as the run that saved it did.")
    weights = []
    for index, (name, model) in enumerate(models.items()):
        path = plain_files.model_file(directory, index)
        state = plain_files.read_weights(path) if path else None
        if state is not None:
            own = {key: (_shape(t) if isinstance(t, torch.nn.Parameter) else tuple(t.shape))
                   for key, t in list(model.named_parameters()) + list(model.named_buffers())}
            wrong = [f"{key}: {tuple(state[key].shape) if key in state else 'absent'} -> {own[key]}" for key in own
                     if key in model.state_dict() and (key not in state or tuple(state[key].shape) != own[key])]
            wrong += [f"{key}: not in {name}" for key in state if key not in own]
            if wrong:
                _refuse(directory, f"{os.path.basename(path)} does not hold the weights of {name} "
                                   f"({type(model).__name__}): {'; '.join(wrong[:5])}",
                        "Pass the same models, in the same order, to accelerator.prepare() as the run that saved it.")
        weights.append(state)
    why = plain_files.adam_refusal(param_groups._base(engine))
    if why:
        _refuse(directory, f"this run's DeepSpeed engine steps another optimizer than Adam ({why})",
                "Use torch.optim.AdamW (or Adam) as the run that saved it did.")
    order = _script_order(engine)
    optimizer_path = os.path.join(directory, plain_files.OPTIMIZER_FILE)
    saved = torch.load(optimizer_path, map_location="cpu", weights_only=False) if os.path.isfile(optimizer_path) else None
    if saved is not None:
        keys = {key for state in saved["state"].values() for key in state}
        if not keys <= {"step", *plain_files.ADAM_STATES}:
            _refuse(directory, f"its optimizer.bin holds {sorted(keys)}, not Adam's exp_avg, exp_avg_sq and step",
                    "Resume it without DeepSpeed, or export the weights and start a new optimizer under DeepSpeed.")
        sizes = [len(group["params"]) for group in saved["param_groups"]]
        if sizes != [len(group) for group in order]:
            _refuse(directory, f"its optimizer has {sizes} parameters per group and this run's, under DeepSpeed, "
                               f"trains {[len(group) for group in order]}",
                    "Build the optimizer over the same parameters, in the same order, as the run that saved it.")
        for group, params in zip(saved["param_groups"], order):
            for index, param in zip(group["params"], params):
                state = saved["state"].get(index, {})
                if "exp_avg" in state and tuple(state["exp_avg"].shape) != _shape(param):
                    _refuse(directory, f"optimizer.bin's parameter {index} has shape {tuple(state['exp_avg'].shape)}"
                                       f" and this run's parameter there ({engine.optimizer.param_names[param]}) "
                                       f"{_shape(param)}",
                            "Build the optimizer over the same parameters, in the same order, as the run that saved "
                            "it.")
    return weights, saved, order


def _full(engine, param):
    """A trained weight as the engine holds it now, whole, in fp32 (what a load hook loaded)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
        return param.data.detach().float().clone()


def _tensors(engine, weights, saved, order):
    """{merged parameter name: {"fp32", "exp_avg", "exp_avg_sq", "step"}} of every trained parameter."""
    names = engine.optimizer.param_names
    prefix_of = {id(p): (f"models.{name}.", weights[i]) for i, (name, model) in enumerate(engine.module.models.items())
                 for p in model.parameters()}
    found, steps = {}, set()
    for g, params in enumerate(order):
        indices = saved["param_groups"][g]["params"] if saved is not None else [None] * len(params)
        for index, param in zip(indices, params):
            name = names[param]
            prefix, state = prefix_of[id(param)]
            key = name[len(prefix):]
            fp32 = state[key].float() if state is not None and key in state else _full(engine, param)
            adam = saved["state"].get(index, {}) if saved is not None else {}
            step = plain_files.step_value(adam["step"]) if "step" in adam else 0.0
            steps.add(step)
            found[name] = {"fp32": fp32.reshape(_shape(param)), "step": torch.tensor(step, dtype=torch.float32),
                           **{k: adam[k].float().reshape(_shape(param)) if k in adam else torch.zeros(_shape(param))
                              for k in plain_files.ADAM_STATES}}
    return found, steps


def _groups(saved, base):
    """The optimizer's group settings as plain accelerate saved them (the learning rate of the save)."""
    if saved is None:
        return [{k: v for k, v in group.items() if k != "params"} for group in base.param_groups]
    return [{k: v for k, v in group.items() if k != "params"} for group in saved["param_groups"]]


def _digest(directory):
    """The sha256 naming the plain checkpoint's content: every file's path and sha256."""
    sha = hashlib.sha256()
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            sha.update(os.path.relpath(path, directory).encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(16 << 20), b""):
                    sha.update(block)
    return sha.hexdigest()


def _write_universal(directory, tag, tensors, groups, step, digest):
    """DeepSpeed's universal checkpoint of the plain files, written beside the folder into a temporary folder, its
    record last, and renamed into place when whole (a copy cut off by a kill is never taken); returns the folder."""
    import deepspeed

    final = universal_copy.converted_path(directory)
    work = os.path.join(os.path.dirname(final), universal_copy.CONVERTING + os.path.basename(os.path.normpath(
        os.path.abspath(directory))))
    for leftover in (work, final):
        if os.path.lexists(leftover):
            shutil.rmtree(leftover)  # a conversion killed half-way, or a copy of other content
    zero = os.path.join(work, tag, "zero")
    try:
        for name, states in tensors.items():
            os.makedirs(os.path.join(zero, name))
            for key in ("fp32", *plain_files.ADAM_STATES):
                torch.save({"param": states[key], "cat_dim": 0}, os.path.join(zero, name, f"{key}.pt"))
            torch.save(states["step"], os.path.join(zero, name, "step.pt"))
        step_tensor = torch.tensor(step, dtype=torch.float32)
        torch.save({"param_groups": groups, "ds_version": deepspeed.__version__,
                    "optimizer_state_dict": {"state": {0: {"step": step_tensor}}, "param_groups": groups}},
                   os.path.join(zero, "optimizer_state.pt"))
        model_states = {"module": {}, "buffer_names": [], "dp_world_size": 1, "mp_world_size": 1,
                        "global_steps": int(step), "skipped_steps": 0, "lr_scheduler": None,
                        "ds_version": deepspeed.__version__}
        first = os.path.join(work, tag, "mp_rank_00_model_states.pt")
        torch.save(model_states, first)
        os.link(first, os.path.join(work, tag, "zero_pp_rank_0_mp_rank_00_model_states.pt"))  # ZeRO-3's name
        with open(os.path.join(work, universal_copy.RECORD), "w", encoding="utf-8") as f:
            json.dump({"source": digest, "tag": tag, "from": "plain accelerate"}, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    os.rename(work, final)
    return final


def _copy_untrained(engine, weights, trained):
    """Frozen weights and buffers from the plain files into the models (the universal loading leaves them as built);
    under ZeRO-3 each frozen weight is gathered, written and partitioned again."""
    import deepspeed

    for (name, model), state in zip(engine.module.models.items(), weights):
        if state is None:
            continue
        for key, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if key not in state or id(tensor) in trained:
                continue
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0, enabled=hasattr(tensor, "ds_id")):
                with torch.no_grad():
                    tensor.data.copy_(state[key].reshape(tensor.data.shape))


def _set_groups(base, groups):
    """Each group's learning rate and settings as saved (DeepSpeed's ZeRO-3 universal load gives every group the
    first one's)."""
    for live, saved in zip(base.param_groups, groups):
        live.update({key: value for key, value in saved.items() if key in live or key == "initial_lr"})


def load(wrapped, accelerator, engines, directory, args, kwargs, hooks_already_run):
    """Accelerator.load_state of a plain accelerate checkpoint into merged models under DeepSpeed."""
    if len(engines) > 1:
        _refuse(directory, f"this run has {len(engines)} DeepSpeed engines (one per optimizer)",
                "Resume it without DeepSpeed, or in a run with one optimizer.")
    engine = engines[0]
    tag = "pytorch_model"
    weights, saved, order = _read(accelerator, engine, directory)
    base = param_groups._base(engine)
    hooks = list(getattr(accelerator, "_load_model_state_pre_hook", {}).values())
    absent = [name for name, state in zip(engine.module.models, weights) if state is None]
    if absent and not hooks:  # plain accelerate's own load fails there too; a save killed between its model files
        files = "; ".join(f"model{e}.safetensors or pytorch_model{e}.bin"
                          for e in (f"_{i}" if i else "" for i, state in enumerate(weights) if state is None))
        _refuse(directory, f"it holds no weights file for {', '.join(absent)} ({files}) "
                           "and this run registered no load hook to load it (a save cut off before it was written?)",
                "Resume from a whole checkpoint, or register the load hook that loads what the save hook wrote.")
    if hooks:  # with the models, before the weights are loaded, as accelerate does
        with models_built_whole():
            load_hooks.run(hooks, list(engine_record(engine).proxies.values()), directory)
    tensors, steps = _tensors(engine, weights, saved, order)
    groups = _groups(saved, base)
    step = max(steps, default=0.0)

    def convert():
        digest = _digest(directory)
        folder = universal_copy.converted_path(directory)
        if universal_copy.reusable(folder, digest, tag):
            return "reused", folder
        return "converted", _write_universal(directory, tag, tensors, groups, step, digest)

    kind, folder = main_decides.on_main_for_all(accelerator, convert, lambda exc: CheckpointError(
        f"accel_ds_fix: converting {directory} for DeepSpeed failed: {type(exc).__name__}: {exc}. Nothing was "
        "loaded; the checkpoint is unchanged."))
    _copy_untrained(engine, weights, {id(p) for group in order for p in group})
    rest = {k: v for k, v in kwargs.items() if k != "input_dir"}
    with layout_change._universal_load(engine, folder), hooks_already_run(), param_groups.kept_across_load(engines):
        result = wrapped(directory, *args[1:], **rest)
    layout_change._steps_as_kept(base)
    _set_groups(base, groups)
    cpu_adam_steps.replay_steps(engine)
    if accelerator.is_main_process:
        names = ", ".join(engine.module.models)
        from_hooks = [n for n, w in zip(engine.module.models, weights) if w is None]
        hooked = f" ({', '.join(from_hooks)}: loaded by the script's load hook)" if from_hooks else ""
        states = f"{type(base).__name__} given optimizer.bin's exp_avg, exp_avg_sq and step {int(step)}, " \
            if saved is not None else "no optimizer.bin: Adam starts anew, "
        notices.say(f"{directory} was saved by plain accelerate; this run is "
                    f"{layout_change.describe(layout_change.of_engine(engine))}: converted it ({names}: the weights"
                    f"{hooked}, {states}the scheduler, the random states) through DeepSpeed's universal checkpoint "
                    f"format in {folder} ({'made now' if kind == 'converted' else 'made before'}, the original "
                    "unchanged)",
                    level=logging.INFO)
    return result
