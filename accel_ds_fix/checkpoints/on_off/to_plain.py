"""A checkpoint that save_state wrote under DeepSpeed with merged models, loaded by the same script under plain
accelerate (no DeepSpeed plugin): a run on a rented multi-GPU machine goes on at home on one card.

accelerate alone looks for its own files there (``model.safetensors``, ``pytorch_model.bin``, ``optimizer.bin``) and
ends in FileNotFoundError. Here the checkpoint's universal copy (layout/universal_copy.py: whole fp32 master weights
and Adam states, one folder per parameter, from any ZeRO stage, process count or offload) is made beside it where
none is, every model gets its weights (the fp32 master weights of what trains; frozen weights and buffers as the
checkpoint holds them) and the script's optimizer its Adam states and step, in the script's own parameter order;
accelerate's own load then restores the scheduler, the random states, the step and the custom objects from the
same folder. Everything is read and checked before any model or optimizer is changed.
"""

import contextlib
import glob
import logging
import os
import types

import torch

from ... import notices
from ...errors import CheckpointError
from ...merge.naming import model_names
from .. import crash_safe, manifest
from ..layout import change as layout_change
from ..layout import universal_copy
from . import plain_files

TAG = "pytorch_model"  # accelerate's DeepSpeed checkpoint of the first engine


def saved_under_deepspeed(directory):
    """Whether ``directory`` (or what a save cut off in its folder swap left for it) is a checkpoint that save_state
    wrote with merged models under DeepSpeed: the manifest says so."""
    return os.path.isfile(os.path.join(directory, manifest.FILENAME)) or bool(crash_safe.leftovers(directory))


def _models(accelerator):
    from accelerate.utils import extract_model_from_parallel

    return [extract_model_from_parallel(model) for model in accelerator._models]


def _refuse(directory, why, fix):
    raise CheckpointError(f"accel_ds_fix: cannot load {directory} without DeepSpeed: {why}. Nothing was loaded. {fix}")


def _check(accelerator, verified, directory):
    """Refusals before anything is converted or loaded; returns (models, their names, the script's optimizer)."""
    content = verified.content
    if content.get("engines"):
        _refuse(directory, f"it holds {len(content['engines'])} DeepSpeed engines (one per optimizer)",
                "Resume it under DeepSpeed, or export the weights (accelerator.save_model) and start new optimizers "
                "from them.")
    models = _models(accelerator)
    names = model_names(models)
    manifest.check(verified, types.SimpleNamespace(models=dict(zip(names, models))))
    if len(accelerator._optimizers) > 1:
        _refuse(directory, f"this run prepared {len(accelerator._optimizers)} optimizers and the checkpoint holds "
                           "the states of one", "Pass one optimizer to accelerator.prepare(), as the run that saved it.")
    optimizer = accelerator._optimizers[0].optimizer if accelerator._optimizers else None
    why = plain_files.adam_refusal(optimizer) if optimizer is not None else None
    if why:
        _refuse(directory, f"the checkpoint holds Adam's states (exp_avg, exp_avg_sq, step) and {why}",
                "Use torch.optim.AdamW (or Adam) as the run that saved it did, or export the weights and start a new "
                "optimizer.")
    return models, names, optimizer


def _universal_copy(accelerator, verified):
    """The checkpoint's universal copy, made by the main process while the others wait (an error on all of them, not
    a hang); returns (folder, seconds taken or None where it was made before)."""
    kind, seconds = layout_change.copy_for_all(accelerator, verified, TAG, "a run without DeepSpeed")
    return universal_copy.converted_path(verified.path), seconds if kind == "converted" else None


def _read_state(path):
    saved = torch.load(path, map_location="cpu", weights_only=False)
    return saved["param"] if isinstance(saved, dict) else saved


def _model_files(directory):
    """The model-states files of the DeepSpeed checkpoint (ZeRO-3: one per process, each with its fragments of the
    frozen weights)."""
    return sorted(glob.glob(os.path.join(directory, TAG, "*mp_rank_00_model_states.pt")))


def _frozen_and_buffers(directory):
    """{merged name: full tensor} of what has no optimizer states: buffers and frozen weights, as saved (in the
    training precision)."""
    files = [torch.load(path, map_location="cpu", weights_only=False) for path in _model_files(directory)]
    module = files[0]["module"]
    found = {name: module[name] for name in files[0].get("buffer_names") or [] if name in module}
    for name, shape in (files[0].get("frozen_param_shapes") or {}).items():  # ZeRO-1 keeps None
        fragments = [f["frozen_param_fragments"][name].flatten() for f in files
                     if name in (f.get("frozen_param_fragments") or {})]
        if fragments:
            found[name] = torch.cat(fragments)[: torch.Size(shape).numel()].view(shape)
    return found


def _weights(directory, folder, models, names):
    """Each model's complete state dict from the checkpoint, keyed as the model keys it; CheckpointError naming what
    is missing."""
    zero = os.path.join(folder, TAG, "zero")
    rest = _frozen_and_buffers(directory)
    canonical, states, missing = {}, [], []
    for model, name in zip(models, names):
        for key, param in model.named_parameters(remove_duplicate=False):
            canonical.setdefault(id(param), f"models.{name}.{key}")  # tied or shared: the name DeepSpeed kept
        state = {}
        params = dict(model.named_parameters(remove_duplicate=False))
        for key in model.state_dict():
            merged = canonical.get(id(params[key])) if key in params else f"models.{name}.{key}"
            path = os.path.join(zero, merged, "fp32.pt")
            if os.path.isfile(path):
                state[key] = _read_state(path)
            elif merged in rest:
                state[key] = rest[merged]
            else:
                missing.append(merged)
        states.append(state)
    if missing:
        _refuse(directory, f"it holds no weights for {len(missing)} of this run's tensors ({', '.join(missing[:5])})",
                "Resume it under DeepSpeed, or save it again with exclude_frozen_parameters=False.")
    return states, canonical


def _optimizer_state(directory, folder, optimizer, canonical):
    """The state dict torch's load_state_dict takes for the script's ``optimizer``: the checkpoint's Adam states
    in the optimizer's own parameter order, its groups' learning rates and settings."""
    zero = os.path.join(folder, TAG, "zero")
    saved = torch.load(os.path.join(zero, "optimizer_state.pt"), map_location="cpu", weights_only=False)
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        _refuse(directory, f"its optimizer had {len(saved_groups)} parameter group(s), this run's has "
                           f"{len(optimizer.param_groups)}", "Build the optimizer as the run that saved it did.")
    state, groups, index, steps = {}, [], 0, set()
    for live, stored in zip(optimizer.param_groups, saved_groups):
        ids = []
        for param in live["params"]:
            name = canonical.get(id(param))
            where = os.path.join(zero, name or "", "exp_avg.pt")
            if name is None:
                _refuse(directory, "the optimizer holds a parameter of no prepared model",
                        "Pass every model the optimizer trains to accelerator.prepare().")
            if os.path.isfile(where):
                entry = {key: _read_state(os.path.join(zero, name, f"{key}.pt")).view(param.shape)
                         for key in plain_files.ADAM_STATES}
                step = plain_files.step_value(torch.load(os.path.join(zero, name, "step.pt"), weights_only=False))
                steps.add(step)
                entry["step"] = torch.tensor(step, dtype=torch.float32)
                state[index] = entry
            ids.append(index)
            index += 1
        group = {key: value for key, value in live.items() if key != "params"}
        # the saved learning rate (the scheduler's, at the save) and settings; the live group's own keys otherwise
        group.update({key: value for key, value in stored.items() if key in live or key == "initial_lr"})
        group["params"] = ids
        groups.append(group)
    return {"state": state, "param_groups": groups}, steps


@contextlib.contextmanager
def _accelerate_loads_the_rest(accelerator, apply):
    """While accelerate's load_state runs (its hooks first): ``apply()`` loads the models and the optimizer, and
    accelerate's own loader restores the rest (schedulers, samplers, random states, step) from the same folder.
    The scaler of an fp16 run has no file in a DeepSpeed checkpoint (its loss scale is DeepSpeed's): it starts anew."""
    import accelerate.accelerator as module

    original = module.load_accelerator_state

    def load_the_rest(input_dir, models, optimizers, schedulers, dataloaders, process_index, scaler=None, *args,
                      **kwargs):
        apply()
        if scaler is not None and not os.path.isfile(os.path.join(input_dir, "scaler.pt")):
            scaler = None
        return original(input_dir, [], [], schedulers, dataloaders, process_index, scaler, *args, **kwargs)

    module.load_accelerator_state = load_the_rest
    try:
        yield
    finally:
        module.load_accelerator_state = original


def load(wrapped, accelerator, directory, args, kwargs):
    """Accelerator.load_state of a merged DeepSpeed checkpoint in a run without DeepSpeed."""
    if accelerator.is_main_process:
        crash_safe.recover(directory)  # a save cut off in its folder swap: the whole checkpoint it left
    accelerator.wait_for_everyone()
    verified = crash_safe.check_whole(directory)
    if verified is None or verified.content is None:
        return wrapped(*args, **kwargs)  # accelerate's own error for a missing folder
    models, names, optimizer = _check(accelerator, verified, directory)
    layout = layout_change.of_checkpoint(directory, TAG, verified.content.get("layout"))
    folder, seconds = _universal_copy(accelerator, verified)
    weights, canonical = _weights(directory, folder, models, names)
    optimizer_state, steps = _optimizer_state(directory, folder, optimizer, canonical) if optimizer else (None, set())

    def apply():
        for model, state in zip(models, weights):
            model.load_state_dict(state)
        if optimizer is not None:
            accelerator._optimizers[0].load_state_dict(optimizer_state)

    rest = {k: v for k, v in kwargs.items() if k != "input_dir"}
    with _accelerate_loads_the_rest(accelerator, apply):
        result = wrapped(directory, *args[1:], **rest)
    if accelerator.is_main_process:
        made = "made now" if seconds is not None else "made before"
        step = f" at step {int(max(steps))}" if steps else ""
        what = "the fp32 master weights of what trains, " if layout and layout["precision"] != "fp32" else "the weights, "
        states = f"{type(optimizer).__name__}'s exp_avg, exp_avg_sq and step{step}, " if optimizer else ""
        notices.say(f"{directory} was saved under DeepSpeed ({layout_change.describe(layout) if layout else 'ZeRO'}); "
                    f"this run has no DeepSpeed: converted it for plain accelerate ({', '.join(names)}: {what}"
                    f"{states}the scheduler, the random states) through its universal copy {folder} ({made}, the "
                    "original unchanged)", level=logging.INFO)
    return result
