"""Which attention kernel fails Flux's backward on a GPU stack: diffusers' FluxTransformer2DModel at Flux.1-dev's
widths (1 double + 1 single block), 512 px (1024 image + 512 text tokens), bf16, gradient checkpointing, one forward
and backward per SDPA setting, each in its own process (an illegal memory access poisons the CUDA context).

    python bench/diffusers/flux_backward_probe.py            # all settings
Found with run 13 (docs/gpu.md): diffusers' Flux scripts died in their first backward on the H200 host's torch
2.11+cu130, with and without DeepSpeed.
"""

import subprocess
import sys

SETTINGS = {
    "default": "",
    "no-cudnn": "torch.backends.cuda.enable_cudnn_sdp(False)",
    "flash-only": "torch.backends.cuda.enable_cudnn_sdp(False); torch.backends.cuda.enable_mem_efficient_sdp(False); "
                  "torch.backends.cuda.enable_math_sdp(False)",
    "efficient-only": "torch.backends.cuda.enable_cudnn_sdp(False); torch.backends.cuda.enable_flash_sdp(False); "
                      "torch.backends.cuda.enable_math_sdp(False)",
    "math-only": "torch.backends.cuda.enable_cudnn_sdp(False); torch.backends.cuda.enable_flash_sdp(False); "
                 "torch.backends.cuda.enable_mem_efficient_sdp(False)",
}

CHILD = """
import torch
from diffusers import FluxTransformer2DModel
{setting}
torch.manual_seed(0)
m = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
                           num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                           guidance_embeds=True, axes_dims_rope=(16, 56, 56)).to("cuda", torch.bfloat16)
m.enable_gradient_checkpointing()
m.train()
img = torch.randn(1, 1024, 64, device="cuda", dtype=torch.bfloat16)
txt = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
img_ids = torch.zeros(1024, 3, device="cuda"); img_ids[:, 1] = torch.arange(1024, device="cuda") // 32
img_ids[:, 2] = torch.arange(1024, device="cuda") % 32
out = m(hidden_states=img, encoder_hidden_states=txt, pooled_projections=torch.randn(1, 768, device="cuda",
        dtype=torch.bfloat16), timestep=torch.tensor([0.5], device="cuda"), img_ids=img_ids,
        txt_ids=torch.zeros(512, 3, device="cuda"), guidance=torch.tensor([3.5], device="cuda"), return_dict=False)[0]
out.float().pow(2).mean().backward()
torch.cuda.synchronize()
print("grad norm", sum(p.grad.float().norm() ** 2 for p in m.parameters() if p.grad is not None).item() ** 0.5)
"""


def main():
    import torch

    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name(0))
    for name, setting in SETTINGS.items():
        proc = subprocess.run([sys.executable, "-c", CHILD.format(setting=setting)], capture_output=True, text=True,
                              env={**__import__("os").environ, "CUDA_LAUNCH_BLOCKING": "1"}, timeout=240)
        lines = proc.stderr.splitlines()
        error = [line for line in lines if "Error" in line or "error" in line][-1:]
        where = [line.strip() for line in lines if line.strip().startswith("File ")][-2:]
        print(f"{name:<15} rc={proc.returncode} {proc.stdout.strip()[-60:]} {' '.join(error)[:300]} {where}", flush=True)


if __name__ == "__main__":
    main()
