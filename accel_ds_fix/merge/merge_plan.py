"""Reads one ``prepare()`` argument list, and the DeepSpeed config it is prepared under, once: where the models,
optimizers and schedulers sit, the models' names, and the checks every engine of the call needs, each refusal
said by one check."""

import torch

from ..deepspeed_config import cpu_optimizer_forced, fp16_enabled, offload_device, zero_stage
from ..errors import MergeError
from ..weights.partitioned import full_numel
from .naming import model_names
from .proxy import is_proxy


def is_optimizer(obj):
    """A torch optimizer, or accelerate's DummyOptim, among prepare()'s arguments."""
    if isinstance(obj, torch.optim.Optimizer):
        return True
    # accelerate's DummyOptim (optimizer defined in the DeepSpeed config) is no torch Optimizer.
    return type(obj).__name__ == "DummyOptim" and hasattr(obj, "params")


def is_scheduler(obj):
    """torch's LRScheduler, diffusers' get_scheduler (a LambdaLR), anything else bound to an optimizer."""
    return not isinstance(obj, torch.optim.Optimizer) and isinstance(getattr(obj, "optimizer", None),
                                                                    torch.optim.Optimizer)


def optimizer_params(optimizer):
    """Every parameter an optimizer (or DummyOptim) holds, group by group."""
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = optimizer.param_groups
    else:
        groups = list(optimizer.params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
    for group in groups:
        params = group["params"]
        yield from ([params] if isinstance(params, torch.Tensor) else params)


def _prepared_as(model):
    """(merged name or None, class name) of something an earlier prepare() returned, else None."""
    if is_proxy(model):
        return model._self_name, type(model.__wrapped__).__name__
    if type(model).__name__ == "DeepSpeedEngine":
        return None, type(model.module).__name__
    return None


def _count(n):
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


class MergePlan:
    """Every argument of one prepare() call classified once (models with their stable names: snake-cased class,
    argument order; optimizers; schedulers; the rest), and what the DeepSpeed config says about them."""

    def __init__(self, args, config=None, mixed_precision=None):
        self.args = list(args)
        self.positions = [i for i, obj in enumerate(args) if isinstance(obj, torch.nn.Module)]
        self.models = [args[i] for i in self.positions]
        self.names = model_names(self.models)
        self.optimizer_positions = [i for i, obj in enumerate(args) if is_optimizer(obj)]
        self.optimizers = [args[i] for i in self.optimizer_positions]
        self.scheduler_positions = [i for i, obj in enumerate(args) if is_scheduler(obj)]
        config = config or {}
        self.stage = zero_stage(config)
        self.optimizer_offload = offload_device(config, "offload_optimizer")
        self.cpu_optimizer_forced = cpu_optimizer_forced(config)
        self.fp16 = fp16_enabled(config) or mixed_precision == "fp16"

    def label(self, index):
        """How messages name the model at ``index`` of self.models: merged name, class and argument number."""
        model = self.models[index]
        prepared = _prepared_as(model)
        cls = prepared[1] if prepared else type(model).__name__
        return f"{self.names[index]} ({cls}, argument {self.positions[index] + 1} of prepare())"

    def optimizer_label(self, k):
        position = self.optimizer_positions[k]
        return f"optimizer {k + 1} ({type(self.args[position]).__name__}, argument {position + 1} of prepare())"

    def model_labels(self, indices):
        return ", ".join(self.label(i) for i in indices)

    def describe(self, stage):
        """The merge line: each model's name, class, parameters (full ZeRO-3 sizes) and trainable parameters."""
        parts = []
        for name, model in zip(self.names, self.models):
            params = list(model.parameters())
            total = _count(sum(full_numel(p) for p in params))
            trainable = _count(sum(full_numel(p) for p in params if p.requires_grad))
            parts.append(f"{name} ({type(model).__name__}, {total} params, {trainable} trainable)")
        return f"merged {len(self.models)} models into one DeepSpeed engine (ZeRO stage {stage}): " + ", ".join(parts)

    def check(self):
        """Raise MergeError for any input that the call's engines cannot train correctly (one merged engine, or
        one per optimizer: optimizer_groups.py checks what is particular to several)."""
        self.check_each_model_once()
        self.check_not_prepared()
        self.check_optimizers_covered()
        if self.cpu_optimizer_forced:
            for optimizer in self.optimizers:
                check_offloadable(optimizer, self.optimizer_offload)

    def check_each_model_once(self):
        for later, model in enumerate(self.models):
            earlier = next(i for i, m in enumerate(self.models) if m is model)
            if earlier != later:
                raise MergeError(
                    f"accel_ds_fix: arguments {self.positions[earlier] + 1} and {self.positions[later] + 1} of "
                    f"prepare() are the same {type(model).__name__} object ({self.names[earlier]}). One engine "
                    "trains each model once: pass every model exactly once, and use the one object prepare() "
                    "returns for it wherever the script needs the model again."
                )

    def check_not_prepared(self):
        prepared = [self.label(i) for i, model in enumerate(self.models) if _prepared_as(model)]
        if prepared:
            raise MergeError(
                f"accel_ds_fix: {' and '.join(prepared)} {'was' if len(prepared) == 1 else 'were'} already "
                "prepared by accelerate (an earlier prepare() returned it). Pass the original models to a single "
                "accelerator.prepare() call, each of them once."
            )

    def check_optimizers_covered(self):
        known = {id(p) for model in self.models for p in model.parameters()}
        for k, optimizer in enumerate(self.optimizers):
            strays = [p for p in optimizer_params(optimizer) if id(p) not in known]
            if not strays:
                continue
            shapes = ", ".join(str(tuple(p.shape)) for p in strays[:10])
            more = f" and {len(strays) - 10} more" if len(strays) > 10 else ""
            which = "the optimizer" if len(self.optimizers) == 1 else self.optimizer_label(k)
            raise MergeError(
                f"accel_ds_fix: {which} holds {len(strays)} parameter(s) that belong to none of the "
                f"{len(self.models)} models passed to prepare(): {self.model_labels(range(len(self.models)))} "
                f"(shapes: {shapes}{more}). DeepSpeed can only train parameters of the modules it wraps: pass the "
                "model that owns them to the same prepare() call, or leave them out of the optimizer."
            )


# Under optimizer offload accelerate (utils.deepspeed.map_pytorch_optim_to_deepspeed) keeps the algorithm only
# for torch's Adam/AdamW/Adagrad and bitsandbytes' 32-bit AdamW/Adagrad (bitsandbytes' Adam maps to Adam, too);
# any other optimizer becomes DeepSpeedCPUAdam silently.
BNB_32BIT_OFFLOADABLE = {"Adam", "Adam32bit", "AdamW", "AdamW32bit", "Adagrad", "Adagrad32bit"}


def _from_bitsandbytes(cls):
    return cls.__module__.startswith("bitsandbytes")


def _offload_keeps(optimizer):
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)):
        return True
    if type(optimizer).__name__ == "DeepSpeedCPUAdam":  # the optimizer offload runs anyway
        return True
    cls = type(optimizer)
    if not _from_bitsandbytes(cls):
        return False
    bits = getattr(optimizer, "optim_bits", None) or getattr(getattr(optimizer, "args", None), "optim_bits", None)
    return bits == 32 and cls.__name__ in BNB_32BIT_OFFLOADABLE


def check_offloadable(optimizer, device):
    """Refuse, before anything is allocated, an optimizer DeepSpeed's offload to ``device`` cannot step."""
    if not isinstance(optimizer, torch.optim.Optimizer) or _offload_keeps(optimizer):
        return
    cls = type(optimizer)
    why = (
        "DeepSpeed's optimizer offload steps with its own 32-bit CPU optimizers (DeepSpeedCPUAdam, Adagrad, "
        "Lion) and has no 8-bit one"
        if _from_bitsandbytes(cls)
        else f"DeepSpeed has no CPU version of {cls.__name__}"
    )
    raise MergeError(
        f"accel_ds_fix: the optimizer is {cls.__module__}.{cls.__name__}, but the DeepSpeed config offloads the "
        f"optimizer to {device}: {why}, and accelerate would silently replace it by DeepSpeedCPUAdam (another "
        "optimizer than the one asked for). Use torch.optim.AdamW (run as DeepSpeedCPUAdam; for kohya scripts: "
        "drop --use_8bit_adam), or turn optimizer offload off (offload_optimizer_device: none), or set "
        '"zero_force_ds_cpu_optimizer": false in the DeepSpeed config JSON: DeepSpeed then steps this optimizer '
        "itself on the offloaded CPU copy (slower than DeepSpeedCPUAdam; tested with bitsandbytes 0.50 AdamW8bit)."
    )
