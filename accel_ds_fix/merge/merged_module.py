"""The one module that DeepSpeed sees when several models are prepared together."""

import contextlib

import torch

from ..memory.hidden_size import hidden_size_of
from .naming import model_names

# The keyword through which a per-model proxy tells the merged module which model to run. It travels through
# DeepSpeedEngine.forward untouched (DeepSpeed only casts floating-point tensors).
TARGET_KEYWORD = "_accel_ds_fix_model"


class MergedConfig:
    """What accelerate reads from ``model.config``: a hidden size for DeepSpeed's ``"auto"`` bucket sizes."""

    def __init__(self, hidden_size, model_names):
        self.hidden_size = hidden_size
        self.model_names = list(model_names)

    def __repr__(self):
        return f"MergedConfig(hidden_size={self.hidden_size}, model_names={self.model_names})"


class MergedModels(torch.nn.Module):
    """Holds every model of one ``prepare()`` call under ``self.models[name]``.

    DeepSpeed wraps this module in a single engine, so one optimizer may hold the parameters of all models.
    ``forward`` runs exactly one of them, picked by the proxy that called the engine.
    """

    def __init__(self, models, names=None, fp32_outputs=False):
        super().__init__()
        names = list(names) if names is not None else model_names(models)
        self.models = torch.nn.ModuleDict(dict(zip(names, models)))
        self.config = MergedConfig(max(hidden_size_of(m) for m in models), names)
        self._compute_dtypes = {}
        # One engine per optimizer (GAN-style scripts): one engine's outputs feed plain modules and the other
        # engine (vqgan's fmap goes into an fp32 timm network); without DeepSpeed accelerate's mixed precision
        # hands outputs back in fp32 (convert_outputs_to_fp32), so these do too.
        self._fp32_outputs = fp32_outputs

    def forward(self, *args, **kwargs):
        name = kwargs.pop(TARGET_KEYWORD, None)
        if name is None:
            raise TypeError(
                "The merged module of accel_ds_fix was called without naming a model. Call the models that "
                "accelerator.prepare() returned (each one runs through the shared DeepSpeed engine), not the engine."
            )
        model = self.models[name]
        with self._autocast_for(name, model):
            outputs = model(*args, **kwargs)
        if self._fp32_outputs and self._compute_dtype(name, model) is not None:
            from accelerate.utils.operations import convert_to_fp32

            outputs = convert_to_fp32(outputs)
        return outputs

    def _autocast_for(self, name, model):
        # DeepSpeed's fp16/bf16 modes turn the weights to half precision but leave the inputs alone, so fp32
        # inputs (latents, noise) would hit a dtype mismatch. Training scripts cover that with autocast
        # (kohya wraps its forward in accelerator.autocast()); do the same when the caller did not.
        dtype = self._compute_dtype(name, model)
        if dtype is None:
            return contextlib.nullcontext()
        device_type = self._device_type(model)
        if torch.is_autocast_enabled(device_type):
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=dtype)

    def _compute_dtype(self, name, model):
        if name not in self._compute_dtypes:
            floating = (p.dtype for p in model.parameters() if p.is_floating_point())
            dtype = next(floating, None)
            self._compute_dtypes[name] = dtype if dtype in (torch.float16, torch.bfloat16) else None
        return self._compute_dtypes[name]

    @staticmethod
    def _device_type(model):
        param = next(model.parameters(), None)
        return param.device.type if param is not None else "cpu"
