"""ZeRO-3 with fp16/bf16: bring the models that did not go through zero.Init to the training precision.

Under a ZeRO-3 config accelerate keeps a HfDeepSpeedConfig alive (whatever zero3_init_flag says), so a
transformers model loaded after the Accelerator exists (kohya's and diffusers' text encoder) is built under
zero.Init: its weights are already ZeRO-3 shards in fp16/bf16. A diffusers or kohya UNet is not. DeepSpeed casts
a module's weights to the training precision only when none of them went through zero.Init, so the merged
module kept the UNet in fp32 beside a bf16 text encoder, and ZeRO-3 stopped in `defragment` with a bare
AssertionError (kohya's train_db.py under the zero3-nvme tier). Casting the others, as DeepSpeed would have,
gives the engine one precision.
"""

import torch

from ..deepspeed_config import section

# DeepSpeed's engine.py CASTABLE_DTYPES: what its own cast converts.
CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KEYS = {"fp16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def training_dtype(config, mixed_precision):
    """fp16/bf16 as the DeepSpeed config (its "auto" filled from accelerate's mixed_precision) sets it, else None."""
    for key, dtype in _KEYS.items():
        enabled = section(config, key).get("enabled", False)
        if enabled is True or (enabled == "auto" and mixed_precision == key.replace("bfloat16", "bf16")):
            return dtype
    return None


def cast_beside_zero3_initialized(models, dtype):
    """Cast the weights that zero.Init did not make to ``dtype`` when others did; return how many were cast."""
    params = [p for model in models for p in model.parameters()]
    if dtype is None or not any(hasattr(p, "ds_id") for p in params):
        return 0
    cast = 0
    for p in params:
        if not hasattr(p, "ds_id") and p.dtype in CASTABLE and p.dtype != dtype:
            p.data = p.data.to(dtype)
            cast += 1
    return cast
