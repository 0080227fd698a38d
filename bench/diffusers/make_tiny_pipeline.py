"""A tiny random Flux, SD3 or SDXL pipeline folder for diffusers' examples/dreambooth scripts, offline: the
transformer (Flux: 1 double and 1 single block; SD3: 1 block) or UNet2DConditionModel (SDXL: 2 blocks, SDXL's
"text_time" conditioning), CLIP text encoder(s) (Flux and SDXL: 2 layers 32 wide; SD3: 1 layer 768 wide and 1 layer
1280 wide), T5EncoderModel (2 layers; not SDXL), AutoencoderKL (one block), FlowMatchEulerDiscreteScheduler (SDXL:
EulerDiscreteScheduler), a byte-level CLIP tokenizer and a T5 tokenizer built from a small vocabulary (none from the
hub), and N random images in OUT/instance.

python make_tiny_pipeline.py {flux,sd3,sdxl} OUT [--images N] [--resolution 32]
"""
import argparse
import os
import sys

import numpy as np
import torch
from PIL import Image

p = argparse.ArgumentParser()
p.add_argument("kind", choices=["flux", "sd3", "sdxl"])
p.add_argument("out")
p.add_argument("--images", type=int, default=4)
p.add_argument("--resolution", type=int, default=32)
a = p.parse_args()
torch.manual_seed(0)
os.makedirs(a.out, exist_ok=True)

import diffusers  # noqa: E402
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler  # noqa: E402
from transformers import CLIPTextConfig, T5Config, T5EncoderModel  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tiny_tokenizers  # noqa: E402

clip_tokenizer = tiny_tokenizers.clip_tokenizer(os.path.join(a.out, "tok_src"))
vocab = clip_tokenizer.get_vocab()
t5_tokenizer = tiny_tokenizers.t5_tokenizer()


def clip(cls, hidden=32, layers=2):
    return cls(CLIPTextConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=37, num_hidden_layers=layers,
                              num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
                              bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                              pad_token_id=vocab["<|endoftext|>"], hidden_act="gelu"))


def t5():
    return T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                   relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1))


def vae(latent_channels):
    return AutoencoderKL(sample_size=a.resolution, in_channels=3, out_channels=3, block_out_channels=(4,),
                         layers_per_block=1, latent_channels=latent_channels, norm_num_groups=1, use_quant_conv=False,
                         use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)


if a.kind == "flux":
    from transformers import CLIPTextModel

    models = {"text_encoder": clip(CLIPTextModel), "text_encoder_2": t5()}
    models["transformer"] = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    models["vae"] = vae(1)
    pipe = diffusers.FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), tokenizer=clip_tokenizer,
                                  tokenizer_2=t5_tokenizer, **models)
elif a.kind == "sdxl":
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    # train_dreambooth_lora_sdxl.py tells its text encoders apart by class (CLIPTextModel / ...WithProjection)
    models = {"text_encoder": clip(CLIPTextModel), "text_encoder_2": clip(CLIPTextModelWithProjection)}
    te, te2 = models["text_encoder"].config, models["text_encoder_2"].config
    time_dim = 8
    # SDXL's conditioning: cross-attention on both encoders' penultimate hidden states concatenated; "text_time"
    # embeds 6 size/crop numbers (time_dim each) and text_encoder_2's pooled projection
    models["unet"] = diffusers.UNet2DConditionModel(
        sample_size=a.resolution, in_channels=4, out_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4), norm_num_groups=4, use_linear_projection=True, transformer_layers_per_block=(1, 1),
        cross_attention_dim=te.hidden_size + te2.hidden_size, addition_embed_type="text_time",
        addition_time_embed_dim=time_dim, projection_class_embeddings_input_dim=time_dim * 6 + te2.projection_dim)
    models["vae"] = vae(4)
    scheduler = diffusers.EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                                 timestep_spacing="leading", steps_offset=1)
    pipe = diffusers.StableDiffusionXLPipeline(scheduler=scheduler, tokenizer=clip_tokenizer,
                                               tokenizer_2=clip_tokenizer, add_watermarker=False, **models)
else:
    from transformers import CLIPTextModelWithProjection

    # CLIP-L's and CLIP-G's widths, one layer each: train_dreambooth_lora_sd3.py's save hook tells its two text
    # encoders apart by hidden_size 768 / 1280 (and saves neither's LoRA otherwise)
    models = {"text_encoder": clip(CLIPTextModelWithProjection, 768, 1),
              "text_encoder_2": clip(CLIPTextModelWithProjection, 1280, 1), "text_encoder_3": t5()}
    models["transformer"] = diffusers.SD3Transformer2DModel(
        sample_size=a.resolution, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64,
        out_channels=4)
    models["vae"] = vae(4)
    pipe = diffusers.StableDiffusion3Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), tokenizer=clip_tokenizer,
                                              tokenizer_2=clip_tokenizer, tokenizer_3=t5_tokenizer, **models)
pipe.save_pretrained(os.path.join(a.out, "model"), safe_serialization=True)

data = os.path.join(a.out, "instance")
os.makedirs(data, exist_ok=True)
rng = np.random.default_rng(0)
for i in range(a.images):
    image = rng.integers(0, 256, (a.resolution, a.resolution, 3), dtype=np.uint8)
    Image.fromarray(image).save(os.path.join(data, f"{i}.png"))
sizes = {name: sum(t.numel() for t in m.parameters()) for name, m in models.items()}
print(f"{a.kind} pipeline in {a.out}/model: {sizes}; {a.images} images in {data}")
