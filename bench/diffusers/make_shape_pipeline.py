"""A diffusers pipeline folder of header-only safetensors files with the real shapes of Flux.1-dev, SD3.5 medium or
large, or SDXL: what `plan --model` reads (the headers), without the gigabytes. The models are built on torch's meta
device from the published configs written out below; the files have no tensor data and load nowhere else.

    python bench/diffusers/make_shape_pipeline.py flux-dev /tmp/flux-dev-shapes
    python -m accel_ds_fix plan --model /tmp/flux-dev-shapes --grid
"""

import argparse
import json
import os

import torch


def clip_l(projection=False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                            max_position_embeddings=77, vocab_size=49408, projection_dim=768)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def clip_g():
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=1280, intermediate_size=5120,
                                                      num_attention_heads=20, num_hidden_layers=32,
                                                      max_position_embeddings=77, vocab_size=49408,
                                                      projection_dim=1280, hidden_act="gelu"))


def t5_xxl():
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
                                   vocab_size=32128, feed_forward_proj="gated-gelu"))


def vae(latent_channels):
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                         block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                         down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)


def flux_dev():
    from diffusers import FluxTransformer2DModel

    return "FluxPipeline", {
        "transformer": FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                                              attention_head_dim=128, num_attention_heads=24,
                                              joint_attention_dim=4096, pooled_projection_dim=768,
                                              guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
        "text_encoder": clip_l(), "text_encoder_2": t5_xxl(), "vae": vae(16)}


def sd35(layers, heads, caption, pos, dual):
    from diffusers import SD3Transformer2DModel

    return "StableDiffusion3Pipeline", {
        "transformer": SD3Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, out_channels=16,
                                             num_layers=layers, attention_head_dim=64, num_attention_heads=heads,
                                             joint_attention_dim=4096, caption_projection_dim=caption,
                                             pooled_projection_dim=2048, pos_embed_max_size=pos,
                                             dual_attention_layers=dual, qk_norm="rms_norm"),
        "text_encoder": clip_l(projection=True), "text_encoder_2": clip_g(), "text_encoder_3": t5_xxl(),
        "vae": vae(16)}


def sdxl():
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(sample_size=128, block_out_channels=(320, 640, 1280), layers_per_block=2,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                                transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
                                cross_attention_dim=2048, addition_embed_type="text_time",
                                addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
                                use_linear_projection=True)
    return "StableDiffusionXLPipeline", {"unet": unet, "text_encoder": clip_l(), "text_encoder_2": clip_g(),
                                         "vae": vae(4)}


KINDS = {
    "flux-dev": flux_dev,
    "sd35-medium": lambda: sd35(24, 24, 1536, 384, tuple(range(13))),
    "sd35-large": lambda: sd35(38, 38, 2432, 192, ()),
    "sdxl": sdxl,
}


def write_header_only(model, path):
    """A safetensors header naming every tensor a checkpoint of the model holds (its state_dict: parameters and
    persistent buffers, such as SD3's positional embedding) with its shape (bf16), and no data after it."""
    header, offset = {}, 0
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)}  # a tied weight is saved once
    tensors = dict(model.named_parameters())
    tensors.update((n, t) for n, t in model.state_dict().items() if n not in tied)
    for name, p in tensors.items():
        size = 2 * p.numel()
        header[name] = {"dtype": "BF16", "shape": list(p.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt", "note": "header only (accel_ds_fix bench): shapes, no data"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)


def checkpoint_elements(model):
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = sum(t.numel() for n, t in model.state_dict().items() if n not in tied)
    return sum(q.numel() for q in model.parameters()) + buffers


def main():
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("out")
    args = p.parse_args()
    with torch.device("meta"):
        pipeline, components = KINDS[args.kind]()
    os.makedirs(args.out, exist_ok=True)
    index = {"_class_name": pipeline}
    for name, model in components.items():
        os.makedirs(os.path.join(args.out, name), exist_ok=True)
        write_header_only(model, os.path.join(args.out, name, "model.safetensors"))
        index[name] = [type(model).__module__.split(".")[0], type(model).__name__]
        print(f"{name}: {type(model).__name__}, {sum(q.numel() for q in model.parameters()) / 1e6:.1f}M parameters, "
              f"{checkpoint_elements(model) / 1e6:.1f}M elements in its checkpoint")
    with open(os.path.join(args.out, "model_index.json"), "w") as f:
        json.dump(index, f, indent=1)


if __name__ == "__main__":
    main()
