"""Reads one ``prepare()`` argument list and decides what to merge, refusing what cannot work."""

import torch

from .errors import MergeError
from .naming import model_names
from .proxy import is_proxy


def _is_optimizer(obj):
    if isinstance(obj, torch.optim.Optimizer):
        return True
    # accelerate's DummyOptim (optimizer defined in the DeepSpeed config) is no torch Optimizer.
    return type(obj).__name__ == "DummyOptim" and hasattr(obj, "params")


def _optimizer_params(optimizer):
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = optimizer.param_groups
    else:
        groups = list(optimizer.params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
    for group in groups:
        params = group["params"]
        yield from ([params] if isinstance(params, torch.Tensor) else params)


def _is_prepared(model):
    return is_proxy(model) or type(model).__name__ == "DeepSpeedEngine"


class MergePlan:
    """Where the models sit in the argument list, their unique instances and their stable names."""

    def __init__(self, args):
        self.positions = [i for i, obj in enumerate(args) if isinstance(obj, torch.nn.Module)]
        self.models = []
        for i in self.positions:
            if not any(args[i] is m for m in self.models):
                self.models.append(args[i])
        self.names = model_names(self.models)
        self.optimizers = [obj for obj in args if _is_optimizer(obj)]

    def name_of(self, model):
        return next(name for m, name in zip(self.models, self.names) if m is model)

    def check(self, offload_device="none", force_cpu_optimizer=True):
        """Raise MergeError for any input that one merged engine cannot train correctly."""
        prepared = [type(m.__wrapped__ if is_proxy(m) else m).__name__ for m in self.models if _is_prepared(m)]
        if prepared:
            raise MergeError(
                f"accel_ds_fix: {', '.join(prepared)} was already prepared by accelerate. Pass the original models "
                "to a single accelerator.prepare() call, each of them once."
            )
        if len(self.optimizers) > 1:
            raise MergeError(
                f"accel_ds_fix: this prepare() call holds {len(self.optimizers)} optimizers, but DeepSpeed builds "
                "one engine with exactly one optimizer for all merged models (ZeRO partitions and steps a single "
                "optimizer state). Put every model's parameters into one optimizer, as parameter groups if they "
                "need their own learning rates, and pass only that optimizer."
            )
        if self.optimizers:
            self._check_optimizer_covered(self.optimizers[0])
            if offload_device not in (None, "none") and force_cpu_optimizer:
                _check_offloadable(self.optimizers[0], offload_device)

    def _check_optimizer_covered(self, optimizer):
        known = {id(p) for model in self.models for p in model.parameters()}
        strays = [p for p in _optimizer_params(optimizer) if id(p) not in known]
        if strays:
            shapes = ", ".join(str(tuple(p.shape)) for p in strays[:10])
            more = f" and {len(strays) - 10} more" if len(strays) > 10 else ""
            raise MergeError(
                f"accel_ds_fix: the optimizer holds {len(strays)} parameter(s) that belong to none of the "
                f"{len(self.models)} models passed to prepare() (shapes: {shapes}{more}). DeepSpeed can only "
                "train parameters of the modules it wraps: pass the model that owns them to the same prepare() "
                "call, or leave them out of the optimizer."
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
    cls = type(optimizer)
    if not _from_bitsandbytes(cls):
        return False
    bits = getattr(optimizer, "optim_bits", None) or getattr(getattr(optimizer, "args", None), "optim_bits", None)
    return bits == 32 and cls.__name__ in BNB_32BIT_OFFLOADABLE


def _check_offloadable(optimizer, device):
    if not isinstance(optimizer, torch.optim.Optimizer) or _offload_keeps(optimizer):
        return
    cls = type(optimizer)
    why = (
        "bitsandbytes' 8-bit optimizers run on the GPU only and have no CPU version"
        if _from_bitsandbytes(cls)
        else f"DeepSpeed has no CPU version of {cls.__name__}"
    )
    raise MergeError(
        f"accel_ds_fix: the optimizer is {cls.__module__}.{cls.__name__}, but the DeepSpeed config offloads the "
        f"optimizer to {device}: {why}, and accelerate would silently replace it by DeepSpeedCPUAdam (another "
        "optimizer than the one asked for). Use torch.optim.AdamW (run as DeepSpeedCPUAdam; for kohya scripts: "
        "drop --use_8bit_adam), or turn optimizer offload off (offload_optimizer_device: none), or set "
        "zero_force_ds_cpu_optimizer to false in the DeepSpeed config to run this optimizer itself on the CPU."
    )
