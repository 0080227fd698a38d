"""save_state / load_state with merged models: one DeepSpeed checkpoint of the merged engine, a manifest of
what it holds, and the state hooks of training scripts called the way accelerate calls them without DeepSpeed.

accelerate's DeepSpeed branch hands save hooks the engine and an empty ``weights`` list, and load hooks no
models at all. Scripts written for the general contract (diffusers: one ``weights.pop()`` per model and a
``save_pretrained`` into a subfolder; a load hook that pops each model and loads adapter weights into it)
then fail. With merged models, the hooks get each model and one ``weights`` entry per model; hooks are
registered untouched, and with nothing merged they run exactly as without this package.

A save of merged models is crash-safe (crash_safe.py): it is written beside the folder and moved into place when
whole, manifest last; load_state refuses a folder that is not exactly what a save wrote.
"""

import collections.abc
import contextlib
import os
import re
import shutil

from ..lookup import engine_record, merged_engines, uses_deepspeed
from ..memory import heap
from ..merge import trainability
from ..merge.proxy import name_the_models, unwrap
from ..processes import deferred_save, every_process
from ..weights import read_alone
from ..weights.partitioned import copied_by_hook, shards
from ..zero3.loading import models_built_whole
from . import (cpu_adam_steps, crash_safe, load_hooks, load_memory, manifest, mapped_load, nvme_resume,
               param_groups)
from .engine_views import merged_view
from .layout import change as layout_change
from .on_off import from_plain, plain_files, to_plain


class ModelWeights(collections.abc.Mapping):
    """One model's entry in a save hook's ``weights`` where reading its state dict means copying it (ZeRO-3
    gathers, ZeRO-1/2 copy out of DeepSpeed's flat buffer): read only if the hook reads it (most hooks only pop
    the entry; a copy of a whole model costs its size again). Pickled (torch.save) as the plain dict it stands
    for."""

    def __init__(self, model):
        self._model = model
        self._state = None

    def _loaded(self):
        if self._state is None:
            self._state = self._model.state_dict()
        return self._state

    def __getitem__(self, key):
        return self._loaded()[key]

    def __iter__(self):
        return iter(self._loaded())

    def __len__(self):
        return len(self._loaded())

    def __repr__(self):
        return f"<weights of {type(self._model).__name__}, read when used>"

    def __reduce__(self):
        return collections.OrderedDict, (list(self._loaded().items()),)


def _weights_entry(model):
    """What accelerate's weights list holds for a model without DeepSpeed: its state dict (tensor references,
    no copies); where that means copying (weights/full_weights.py), the same read only when used."""
    if any(copied_by_hook(p) for p in model.parameters()):
        return ModelWeights(model)
    return model.state_dict()


def _each_model(engines, models):
    """accelerate's model list with each merged engine replaced by its models' proxies, in argument order."""
    split = []
    for model in models:
        split.extend(engine_record(model).proxies.values() if any(model is e for e in engines) else [model])
    return split


@contextlib.contextmanager
def _hooks_replaced(accelerator, attribute, adapt):
    """Run accelerate's call with each registered hook replaced by ``adapt(hook)``; the user's own hook
    objects are put back afterwards (handles stay valid: the same dict is changed in place)."""
    hooks = getattr(accelerator, attribute, None)
    if not hooks:
        yield
        return
    registered = dict(hooks)
    for key, hook in registered.items():
        hooks[key] = adapt(hook)
    try:
        yield
    finally:
        hooks.clear()
        hooks.update(registered)


@contextlib.contextmanager
def _gathered_for_hook(accelerator, engines):
    # With several processes, a save hook that saves on the main process only (diffusers' do) would gather
    # ZeRO-3 weights there alone and hang: gather them on every process around the hook instead.
    params = shards(p for e in engines for p in e.module.parameters()) if accelerator.num_processes > 1 else []
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


def save_state(wrapped, instance, args, kwargs):
    """Accelerator.save_state: DeepSpeed's checkpoint of the merged engine, plus what it holds (manifest), written
    beside the folder and moved into place once whole."""
    engines = merged_engines(instance)  # one per optimizer of a GAN-style prepare(), else one
    if not engines:
        return wrapped(*args, **kwargs)
    for engine in engines:
        trainability.warn_if_changed(engine)

    def per_model(hook):
        def save_hook(models, weights, output_dir):
            each = _each_model(engines, models)
            # One entry per model, as without DeepSpeed. What the hook leaves in it is not written again:
            # DeepSpeed's checkpoint already holds every weight (accelerate's own `weights` stays empty).
            with _gathered_for_hook(instance, engines), models_built_whole():
                try:
                    hook(each, [_weights_entry(unwrap(m)) for m in each], output_dir)
                except Exception as error:
                    name_the_models(error, each)
                    raise

        return save_hook

    target = _output_dir(instance, args, kwargs)
    if target is None:
        return wrapped(*args, **kwargs)  # accelerate's own error
    # before any collective: a call on the main process alone is handed to the next step where all processes are
    if not deferred_save.is_running() and not every_process.wait_for_all(target, deferred_save.defer):
        return target
    rest = {k: v for k, v in kwargs.items() if k != "output_dir"}

    def save_into(folder):
        # The save goes to a temporary folder beside the target (crash_safe.py), hooks included.
        with _hooks_replaced(instance, "_save_model_state_pre_hook", per_model), _automatic_naming_off(instance):
            return wrapped(folder, *args[1:], **rest)

    def write_manifest(folder, files, kept):
        # every engine of one prepare() trains under the same DeepSpeed config: one layout
        merged = merged_view(engines, lambda e: _checkpoint_tag(instance, e))
        manifest.write(folder, merged, files, kept, layout_change.of_engine(engines[0]))

    exclude_frozen = rest.get("exclude_frozen_parameters", False)
    location = crash_safe.save(instance, target, save_into, write_manifest,
                               lambda: _checkpoint_bytes(engines, exclude_frozen))
    return type(location)(target) if isinstance(location, (str, os.PathLike)) else location


def _output_dir(accelerator, args, kwargs):
    """Where accelerate's save_state would write: the folder given, or with automatic checkpoint naming
    ``project_dir/checkpoints/checkpoint_<iteration>`` after deleting the oldest beyond ``total_limit``, as
    accelerate does (the save itself then runs with the naming off, into the temporary folder)."""
    config = getattr(accelerator, "project_configuration", None)
    if not getattr(config, "automatic_checkpoint_naming", False):
        directory = args[0] if args else kwargs.get("output_dir")
        return os.path.normpath(os.path.expanduser(os.fspath(directory))) if directory is not None else None
    root = os.path.join(accelerator.project_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    folders = [os.path.join(root, f) for f in os.listdir(root) if not crash_safe.is_temporary(f)]
    limit = config.total_limit
    if limit is not None and len(folders) + 1 > limit and accelerator.is_main_process:
        folders.sort(key=lambda folder: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)[0]))
        for folder in folders[: len(folders) + 1 - limit]:
            shutil.rmtree(folder)
    target = os.path.join(root, f"checkpoint_{config.iteration}")
    if os.path.exists(target):
        raise ValueError(
            f"Checkpoint directory {target} ({config.iteration}) already exists. Please manually override "
            "`self.save_iteration` with what iteration to start with."
        )
    accelerator.wait_for_everyone()
    return target


@contextlib.contextmanager
def _automatic_naming_off(accelerator):
    config = getattr(accelerator, "project_configuration", None)
    automatic = getattr(config, "automatic_checkpoint_naming", False)
    if automatic:
        config.automatic_checkpoint_naming = False
    try:
        yield
    finally:
        if automatic:
            config.automatic_checkpoint_naming = True


def _input_dir(instance, args, kwargs):
    directory = args[0] if args else kwargs.get("input_dir")
    automatic = getattr(getattr(instance, "project_configuration", None), "automatic_checkpoint_naming", False)
    if directory is None and automatic:
        return manifest.automatic_checkpoint(instance.project_dir)
    return os.path.expanduser(directory) if directory is not None else None


def load_state(wrapped, instance, args, kwargs):
    """Accelerator.load_state: check the checkpoint holds these models, run the load hooks with the models
    (before any weights are loaded, as accelerate does without DeepSpeed), then let DeepSpeed restore the
    engine, which overrides whatever the hooks loaded."""
    engines = merged_engines(instance)  # one per optimizer of a GAN-style prepare(), else one
    read_alone.forget()  # the weights are about to change without an optimizer step
    if not engines and not uses_deepspeed(instance):  # DeepSpeed off now: a merged DeepSpeed checkpoint converts
        directory = _input_dir(instance, args, kwargs)
        if directory is not None and to_plain.saved_under_deepspeed(directory):
            return to_plain.load(wrapped, instance, directory, args, kwargs)
    directory = _input_dir(instance, args, kwargs) if engines else None
    if directory is not None:
        if instance.is_main_process:
            crash_safe.recover(directory)  # a save cut off in its folder swap: the whole checkpoint it left
        instance.wait_for_everyone()
        verified = crash_safe.check_whole(directory)  # a partial, mixed or altered folder: refused before loading
    if directory is None or verified is None:
        return wrapped(*args, **kwargs)  # accelerate's own handling, and its own error for a missing folder
    if verified.content is None and plain_files.written_by_plain_accelerate(directory):  # DeepSpeed on now
        return from_plain.load(wrapped, instance, engines, directory, args, kwargs,
                               lambda: _hooks_replaced(instance, "_load_model_state_pre_hook", lambda h: _already_called))
    merged = merged_view(engines, lambda e: _checkpoint_tag(instance, e))
    saved = manifest.check(verified, merged)
    tags = [_checkpoint_tag(instance, engine) for engine in engines]
    saved_layout = layout_change.of_checkpoint(directory, tags[0], saved["layout"])
    # refusals before the hooks: what cannot be converted, and (for now) any conversion of several engines
    converting = layout_change.check(directory, saved_layout, layout_change.of_engine(engines[0]))
    if converting and len(engines) > 1:
        layout_change.refuse_several_engines(directory, saved_layout, layout_change.of_engine(engines[0]), tags)
    if not converting:  # DeepSpeed's own load, which reads each process's ZeRO file whole
        for engine, tag in zip(engines, tags):
            load_memory.check(engine, directory, tag)
    for engine in engines:
        trainability.warn_if_changed(engine)
    hooks = list(getattr(instance, "_load_model_state_pre_hook", {}).values())
    if hooks:
        models = [proxy for engine in engines for proxy in engine_record(engine).proxies.values()]
        with models_built_whole():
            load_hooks.run(hooks, models, directory)
    # several engines reach here only in the layout that saved them (refused above otherwise): nothing converted
    with layout_change.resumed(instance, engines[0], verified, tags[0], saved_layout) as converted:
        with _hooks_replaced(instance, "_load_model_state_pre_hook", lambda hook: _already_called):
            with trainability.as_saved(merged, saved["frozen"]), param_groups.kept_across_load(engines):
                # the folder checked, also where accelerate would pick it (automatic naming: the highest number)
                rest = {k: v for k, v in kwargs.items() if k != "input_dir"}
                # the files mapped, not read whole beside the training (a universal copy is read by its own loader)
                with mapped_load.mapped([] if converted else engines):
                    result = wrapped(directory, *args[1:], **rest)
    if not converted:  # a universal copy holds every sub group's states: nothing skipped to restore
        for engine, tag in zip(engines, tags):
            nvme_resume.restore(engine, directory, tag)
    for engine in engines:
        cpu_adam_steps.replay_steps(engine)
    heap.return_freed_memory()  # what the load freed, so that the resumed run holds no more than a fresh one
    return result


def _checkpoint_bytes(engines, exclude_frozen=False):
    """At least what a save of these engines writes, so that a save refused for room surely would not have fit
    (crash_safe): the model states file's weights in their dtype (under ZeRO-3 the frozen ones only: its trained
    weights are saved as their fp32 partitions), the fp32 master weights of what trains (the weights themselves in
    an fp32 training without ZeRO), and the optimizer's states as this process holds them, once for each process
    that holds a partition of them."""
    total = 0
    for engine in engines:
        stage = engine.zero_optimization_stage()
        for p in engine.module.parameters():
            numel = getattr(p, "ds_numel", p.numel())
            if not p.requires_grad:
                total += 0 if exclude_frozen else numel * p.element_size()
                continue
            total += numel * p.element_size() if stage < 3 else 0
            total += 4 * numel if stage or p.element_size() < 4 else 0
        base = getattr(engine.optimizer, "optimizer", engine.optimizer)
        states = sum(t.nbytes for state in base.state.values() for t in state.values() if hasattr(t, "nbytes"))
        total += states * (engine.dp_world_size if stage else 1)
    return total


def _checkpoint_tag(accelerator, engine):
    # accelerate's save_state/load_state name engine i's checkpoint MODEL_NAME, then MODEL_NAME_i
    from accelerate.utils import MODEL_NAME

    index = accelerator._models.index(engine)
    return MODEL_NAME if index == 0 else f"{MODEL_NAME}_{index}"


def _already_called(models, input_dir):
    """Stands in for a load hook during accelerate's own call: it ran already, with the models."""
