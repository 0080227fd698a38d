"""torch.nn.utils.spectral_norm under DeepSpeed bf16/fp16 (DeepSpeed >= 0.18: the engine casts parameters only and
keeps fp32 buffers). spectral_norm's power iteration writes ``torch.mv(weight.t(), u, out=v)`` with the weight
(``<name>_orig``, a parameter: now bf16) and its ``_u`` / ``_v`` buffers (still fp32): out= ops are not autocast,
so every forward dies with "addmv input tensors must have the same dtype" (diffusers' vqgan Discriminator). Without
DeepSpeed, accelerate's mixed precision keeps all three in fp32. The buffers are brought to the weight's dtype
once the engine exists."""

import torch


def match_buffers_to_weights(module):
    """Cast each spectral_norm's ``_u`` / ``_v`` buffers to its (DeepSpeed-cast) weight's dtype; return how many."""
    from torch.nn.utils.spectral_norm import SpectralNorm

    changed = 0
    for sub in module.modules():
        for hook in sub._forward_pre_hooks.values():
            if not isinstance(hook, SpectralNorm):
                continue
            weight = getattr(sub, hook.name + "_orig")
            for suffix in ("_u", "_v"):
                buffer = getattr(sub, hook.name + suffix)
                if buffer.dtype != weight.dtype and weight.dtype in (torch.float16, torch.bfloat16):
                    buffer.data = buffer.data.to(weight.dtype)
                    changed += 1
    return changed
