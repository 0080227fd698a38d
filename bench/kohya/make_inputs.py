"""Random SD1.5-layout inputs for kohya's train_db.py, offline: a diffusers pipeline folder (UNet, CLIP-L text
encoder, VAE, scheduler), a CLIP tokenizer with a byte-level vocabulary (kohya's --tokenizer_cache_dir layout and
the January 2023 scripts' relative "openai/clip-vit-large-patch14" folder), and N random 512 px images in "1_sks dog".

python make_inputs.py OUT [--tiny [--unet-channels 32,64,64,64]] [--images N]
"""
import argparse
import os
import sys

import numpy as np
import torch
from PIL import Image

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--tiny", action="store_true", help="tiny text encoder and VAE, SD1.5 UNet layout with 32-wide cross-attention")
p.add_argument("--unet-channels", help="with --tiny: the UNet's block widths, e.g. 32,64,64,64 (kohya_val's "
               "KOHYA_VAL_UNET_CHANNELS builds kohya's UNet alike); default SD1.5's 320,640,1280,1280")
p.add_argument("--images", type=int, default=2)
p.add_argument("--resolution", type=int, default=512)
a = p.parse_args()
if a.unet_channels and not a.tiny:
    p.error("--unet-channels narrows the --tiny model's UNet: add --tiny (the full-size inputs are SD1.5's widths)")
torch.manual_seed(0)
os.makedirs(a.out, exist_ok=True)

from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel  # noqa: E402
from transformers import CLIPTextConfig, CLIPTextModel  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiny_tokenizers  # noqa: E402

tokenizer = tiny_tokenizers.clip_tokenizer(os.path.join(a.out, "tok_src"))
for where in ("tokenizer_cache/openai_clip-vit-large-patch14", "openai/clip-vit-large-patch14"):
    tokenizer.save_pretrained(os.path.join(a.out, where))

if a.tiny:
    # kohya's newest script always builds the SD1.5 UNet layout and loads these weights into it
    widths = tuple(int(c) for c in a.unet_channels.split(",")) if a.unet_channels else (320, 640, 1280, 1280)
    unet = UNet2DConditionModel(sample_size=8, cross_attention_dim=32, attention_head_dim=8, block_out_channels=widths)
    te = CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=77, projection_dim=32, hidden_act="quick_gelu"))
    vae = AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8, layers_per_block=1)
else:
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8)
    te = CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                      num_attention_heads=12, max_position_embeddings=77, projection_dim=768,
                                      hidden_act="quick_gelu"))
    vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=4, layers_per_block=2, sample_size=512)
scheduler = PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True)
pipe = StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
                               safety_checker=None, feature_extractor=None, requires_safety_checker=False)
pipe.save_pretrained(os.path.join(a.out, "model"), safe_serialization=True)

data = os.path.join(a.out, "train_data", "1_sks dog")
os.makedirs(data, exist_ok=True)
rng = np.random.default_rng(0)
for i in range(a.images):
    Image.fromarray(rng.integers(0, 256, (a.resolution, a.resolution, 3), dtype=np.uint8)).save(os.path.join(data, f"{i}.png"))
print(f"inputs in {a.out}: unet {sum(t.numel() for t in unet.parameters()) / 1e6:.1f}M, "
      f"text encoder {sum(t.numel() for t in te.parameters()) / 1e6:.1f}M, {a.images} images")
