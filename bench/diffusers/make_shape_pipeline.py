"""A diffusers pipeline folder with the real shapes of Flux.1-dev, SD3.5 medium or large, or SDXL. The models are
built on torch's meta device from the published configs written out below.

By default the safetensors files are header-only: what `plan --model` reads (the headers), without the gigabytes;
they load nowhere else.

With --random (flux-dev, sd35-large, sdxl) the folder is a loadable pipeline (FluxPipeline.from_pretrained, diffusers'
train_dreambooth_lora_flux.py, _sd3.py, _sdxl.py) with random bf16 weights: each tensor is drawn on the GPU where there is one (std 0.02;
norm weights 1, biases 0), copied to the host and written at once into sharded safetensors files with their index
json, as save_pretrained shards (the transformer in 10 GB files, T5 in 5 GB ones, as the published repository), so
host memory holds one tensor at a time. The configs say bfloat16, as the published ones do. Tokenizers are built
offline from tiny vocabularies (bench/tiny_tokenizers.py: every id within the embeddings), the scheduler is
Flux.1-dev's. The whole pipeline is 33.6 GB; drawn on a 2-core CPU, 0.1 GB/s (`--blocks 1,1`: 11 GB in 106 s,
757 MB of host memory at the peak); on the GPU the disk sets the pace (not measured yet).

    python bench/diffusers/make_shape_pipeline.py flux-dev /tmp/flux-dev-shapes
    python -m accel_ds_fix plan --model /tmp/flux-dev-shapes --grid
    python bench/diffusers/make_shape_pipeline.py flux-dev /var/tmp/flux-dev --random
    python bench/diffusers/make_shape_pipeline.py flux-dev /tmp/flux-1-1 --random --blocks 1,1  # 1+1 blocks
    python bench/diffusers/make_shape_pipeline.py flux-dev /tmp/flux-tiny --random --tiny       # a CPU rehearsal
    python bench/diffusers/make_shape_pipeline.py flux-dev /tmp/flux-4-8 --blocks 4,8 --t5-layers 2  # headers only
"""

import argparse
import json
import os
import shutil
import sys
import time

import torch

# Flux.1-dev's published shapes; --tiny swaps in those of make_tiny_pipeline.py's Flux (a CPU rehearsal of the kit)
FLUX_DEV = {"transformer": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
            "clip": dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                         projection_dim=768),
            "t5": dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24),
            "vae": dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32,
                        latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159)}
FLUX_TINY = {"transformer": dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                 guidance_embeds=True, axes_dims_rope=(4, 4, 8)),
             "clip": dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                          projection_dim=32),
             "t5": dict(d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2, relative_attention_num_buckets=8),
             "vae": dict(block_out_channels=(4,), layers_per_block=1, norm_num_groups=1, latent_channels=1,
                         scaling_factor=1.5035, shift_factor=0.0609)}


def clip_l(projection=False, **overrides):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                  max_position_embeddings=77, vocab_size=49408, projection_dim=768)
    config.update(overrides)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(CLIPTextConfig(**config))


def clip_g(**overrides):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=20, num_hidden_layers=32,
                  max_position_embeddings=77, vocab_size=49408, projection_dim=1280, hidden_act="gelu")
    config.update(overrides)
    return CLIPTextModelWithProjection(CLIPTextConfig(**config))


def t5_xxl(**overrides):
    from transformers import T5Config, T5EncoderModel

    config = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
                  feed_forward_proj="gated-gelu")
    config.update(overrides)
    return T5EncoderModel(T5Config(**config))


def vae(latent_channels, block_out_channels=(128, 256, 512, 512), layers_per_block=2, **overrides):
    from diffusers import AutoencoderKL

    n = len(block_out_channels)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                         block_out_channels=block_out_channels, layers_per_block=layers_per_block,
                         down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
                         **overrides)


def flux_dev(sizes=FLUX_DEV, blocks=None, token_ids=None, t5_layers=None):
    """Flux.1-dev's four models; blocks=(double, single) keeps its widths with fewer blocks, t5_layers T5's width
    with fewer layers; token_ids: the tokenizers' CLIP bos/eos/pad ids and T5 vocabulary size (the embeddings keep
    their published sizes unless tiny)."""
    from diffusers import FluxTransformer2DModel

    transformer = dict(sizes["transformer"])
    if blocks:
        transformer.update(num_layers=blocks[0], num_single_layers=blocks[1])
    clip, t5 = dict(sizes["clip"]), dict(sizes["t5"], feed_forward_proj="gated-gelu")
    if t5_layers:
        t5.update(num_layers=t5_layers)
    if token_ids:
        clip.update(bos_token_id=token_ids["bos"], eos_token_id=token_ids["eos"], pad_token_id=token_ids["pad"])
        if sizes is FLUX_TINY:  # make_tiny_pipeline.py's: embeddings as large as the tiny vocabularies
            clip.update(vocab_size=token_ids["clip_vocab"], hidden_act="gelu")
            t5.update(vocab_size=token_ids["t5_vocab"], pad_token_id=0, eos_token_id=1)
    # Flux's VAE has no quant convs (published config); sample_size as the published 1024
    return "FluxPipeline", {
        "transformer": FluxTransformer2DModel(**transformer),
        "text_encoder": clip_l(**clip), "text_encoder_2": t5_xxl(**t5),
        "vae": vae(**sizes["vae"], use_quant_conv=False, use_post_quant_conv=False, sample_size=1024)}


def sd35(layers, heads, caption, pos, dual, token_ids=None):
    from diffusers import SD3Transformer2DModel

    tokens = {}
    if token_ids:
        tokens = dict(bos_token_id=token_ids["bos"], eos_token_id=token_ids["eos"], pad_token_id=token_ids["pad"])
    return "StableDiffusion3Pipeline", {
        "transformer": SD3Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, out_channels=16,
                                             num_layers=layers, attention_head_dim=64, num_attention_heads=heads,
                                             joint_attention_dim=4096, caption_projection_dim=caption,
                                             pooled_projection_dim=2048, pos_embed_max_size=pos,
                                             dual_attention_layers=dual, qk_norm="rms_norm"),
        "text_encoder": clip_l(projection=True, **tokens), "text_encoder_2": clip_g(**tokens),
        "text_encoder_3": t5_xxl(), "vae": vae(16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                                               use_post_quant_conv=False, sample_size=1024)}


# SDXL's published UNet; --tiny narrows it to SDXL_TINY_CHANNELS (kohya's sdxl_train.py rebuilds it as its own
# SdxlUNet2DConditionModel, which bench/kohya/kohya_val.py's KOHYA_VAL_SDXL_CHANNELS narrows alike) with both text
# encoders at their widths (the UNet's 2048-wide cross-attention is theirs together), CLIP-G with two layers
# (kohya reads CLIP-L's 11th hidden state, so CLIP-L keeps its 12)
SDXL_TINY_CHANNELS = 64


def sdxl(tiny=False, token_ids=None):
    from diffusers import UNet2DConditionModel

    c = SDXL_TINY_CHANNELS if tiny else 320
    unet = UNet2DConditionModel(sample_size=128, block_out_channels=(c, 2 * c, 4 * c), layers_per_block=2,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                                transformer_layers_per_block=(1, 2, 10), attention_head_dim=(c // 64, c // 32, c // 16),
                                cross_attention_dim=2048, addition_embed_type="text_time",
                                addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
                                use_linear_projection=True)
    tokens = {}
    if token_ids:
        tokens = dict(bos_token_id=token_ids["bos"], eos_token_id=token_ids["eos"], pad_token_id=token_ids["pad"])
    layers = dict(num_hidden_layers=2) if tiny else {}
    vae_shape = dict(block_out_channels=(32,) * 4, layers_per_block=1, norm_num_groups=8) if tiny else {}
    return "StableDiffusionXLPipeline", {"unet": unet, "text_encoder": clip_l(**tokens),
                                         "text_encoder_2": clip_g(**tokens, **layers),
                                         "vae": vae(4, **vae_shape, scaling_factor=0.13025, sample_size=1024)}


KINDS = {
    "flux-dev": flux_dev,
    "sd35-medium": lambda token_ids=None: sd35(24, 24, 1536, 384, tuple(range(13)), token_ids),
    "sd35-large": lambda token_ids=None: sd35(38, 38, 2432, 192, (), token_ids),
    "sdxl": sdxl,
}


def checkpoint_tensors(model):
    """{name: tensor} of what a checkpoint of the model holds (its state_dict: parameters and persistent buffers,
    such as SD3's positional embedding), a tied weight once."""
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tensors = dict(model.named_parameters())
    tensors.update((n, t) for n, t in model.state_dict().items() if n not in tied)
    if type(model).__name__ == "CLIPTextModel" and not any(n.startswith("text_model.") for n in tensors):
        # transformers >= 5 dropped the text_model level of CLIPTextModel; the published checkpoints keep it,
        # and transformers 4 (kohya's pin) loads only that layout (5 reads both)
        tensors = {"text_model." + n: t for n, t in tensors.items()}
    return tensors


def safetensors_header(entries, note=None):
    """A safetensors header (8-byte length, JSON padded to 8 bytes) for [(name, shape, dtype tag, bytes)], the data
    laid out in that order."""
    header, offset = {}, 0
    for name, shape, tag, size in entries:
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt", **({"note": note} if note else {})}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_header_only(model, path):
    """A safetensors header naming every tensor a checkpoint of the model holds with its shape (bf16), and no data
    after it."""
    entries = [(n, t.shape, "BF16", 2 * t.numel()) for n, t in checkpoint_tensors(model).items()]
    with open(path, "wb") as f:
        f.write(safetensors_header(entries, "header only (accel_ds_fix bench): shapes, no data"))


def checkpoint_elements(model):
    return sum(t.numel() for t in checkpoint_tensors(model).values())


# --random: the saved dtype of each tensor (floating ones in bf16, as the published checkpoint) and its values
TAGS = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL"}


def saved_dtype(t):
    return torch.bfloat16 if t.is_floating_point() else t.dtype


def random_tensor(name, t, device, generator, std=0.02):
    if not t.is_floating_point() or name.endswith("bias"):
        return torch.zeros(t.shape, dtype=saved_dtype(t), device=device)
    if t.ndim == 1 and "norm" in name.lower():
        return torch.ones(t.shape, dtype=torch.bfloat16, device=device)
    return torch.empty(t.shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=generator)


def write_random(model, folder, weights_name, shard_bytes, device, generator):
    """The model's checkpoint with random values, in files of at most shard_bytes (a larger tensor alone in one),
    named and indexed as save_pretrained names them (weights_name: model.safetensors or
    diffusion_pytorch_model.safetensors). Returns the bytes written."""
    tensors = checkpoint_tensors(model)
    shards, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * saved_dtype(t).itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t, nbytes))
        size += nbytes
    stem, ext = weights_name.rsplit(".", 1)
    names = [weights_name] if len(shards) == 1 else \
        [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file, shard in zip(names, shards):
        with open(os.path.join(folder, file), "wb") as f:
            f.write(safetensors_header([(n, t.shape, TAGS[saved_dtype(t)], b) for n, t, b in shard]))
            for name, t, nbytes in shard:
                values = random_tensor(name, t, device, generator).cpu().reshape(-1)
                f.write(values.view(torch.uint8).numpy().data)
                weight_map[name] = file
                total += nbytes
    if len(shards) > 1:
        with open(os.path.join(folder, weights_name + ".index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return total


def save_config(model, folder):
    if hasattr(model, "save_config"):  # diffusers
        model.save_config(folder)
    else:  # transformers: what save_pretrained writes beside the weights, in the published bf16
        model.config.architectures = [type(model).__name__]
        setattr(model.config, "dtype" if hasattr(model.config, "dtype") else "torch_dtype", torch.bfloat16)
        model.config.save_pretrained(folder)


def tokenizers(out, second="t5", third=False):
    """The tiny offline tokenizers, saved into OUT/tokenizer and OUT/tokenizer_2 (T5's for Flux, a second CLIP
    tokenizer for SDXL and SD3) and, with third, T5's into OUT/tokenizer_3 (SD3): their ids and classes."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import tiny_tokenizers

    clip = tiny_tokenizers.clip_tokenizer(os.path.join(out, "tokenizer"))
    other = tiny_tokenizers.t5_tokenizer(model_max_length=512) if second == "t5" else clip
    clip.save_pretrained(os.path.join(out, "tokenizer"))
    if other is clip:  # with the vocabulary files that transformers 4's slow CLIPTokenizer reads
        shutil.copytree(os.path.join(out, "tokenizer"), os.path.join(out, "tokenizer_2"), dirs_exist_ok=True)
    else:
        other.save_pretrained(os.path.join(out, "tokenizer_2"))
    entries = {"tokenizer": ["transformers", type(clip).__name__], "tokenizer_2": ["transformers", type(other).__name__]}
    if third:
        t5 = tiny_tokenizers.t5_tokenizer(model_max_length=512)
        t5.save_pretrained(os.path.join(out, "tokenizer_3"))
        entries["tokenizer_3"] = ["transformers", type(t5).__name__]
    vocab = clip.get_vocab()
    ids = {"bos": vocab["<|startoftext|>"], "eos": vocab["<|endoftext|>"], "pad": vocab["<|endoftext|>"],
           "clip_vocab": len(vocab), "t5_vocab": len(other)}
    return ids, entries


def main():
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("out")
    p.add_argument("--random", action="store_true", help="flux-dev, sd35-large, sdxl: random bf16 weights, a "
                   "loadable pipeline")
    p.add_argument("--tiny", action="store_true", help="with --random: make_tiny_pipeline.py's tiny Flux shapes; "
                   "SDXL's UNet narrowed to %d channels, CLIP-G with two layers" % SDXL_TINY_CHANNELS)
    p.add_argument("--blocks", help="flux-dev: D,S double and single transformer blocks at the real widths")
    p.add_argument("--t5-layers", type=int, help="flux-dev: T5 with this many layers at the real width (d_model "
                   "4096, which the transformer's context embedder takes)")
    p.add_argument("--shard-gb", type=float, help="with --random: largest file, GB (default: 10 for the "
                   "transformer, 5 for the text encoders, as the published repository)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="with --random: where the values are drawn (default: cuda where there is one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.tiny and not args.random or args.random and args.kind not in ("flux-dev", "sd35-large", "sdxl"):
        p.error("--tiny goes with --random, which makes flux-dev, sd35-large and sdxl")
    if args.tiny and args.kind == "sd35-large":
        p.error("a tiny SD3: bench/diffusers/make_tiny_pipeline.py sd3")
    if (args.blocks or args.t5_layers) and args.kind != "flux-dev":
        p.error("--blocks and --t5-layers are flux-dev's")
    os.makedirs(args.out, exist_ok=True)
    index, token_ids = {"_class_name": None}, None
    if args.random:
        import diffusers
        from diffusers import FlowMatchEulerDiscreteScheduler

        index["_diffusers_version"] = diffusers.__version__
        token_ids, tokenizer_entries = tokenizers(args.out, "t5" if args.kind == "flux-dev" else "clip",
                                                  third=args.kind == "sd35-large")
        if args.kind == "flux-dev":
            scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                        max_shift=1.15, num_train_timesteps=1000, shift=3.0,
                                                        use_dynamic_shifting=True)
        elif args.kind == "sd35-large":  # SD3.5-large's published scheduler
            scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
        else:  # SDXL base's published scheduler
            from diffusers import EulerDiscreteScheduler

            scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                               num_train_timesteps=1000, steps_offset=1, timestep_spacing="leading")
            index["force_zeros_for_empty_prompt"] = True
        scheduler.save_pretrained(os.path.join(args.out, "scheduler"))
        index.update(tokenizer_entries, scheduler=["diffusers", type(scheduler).__name__],
                     feature_extractor=[None, None], image_encoder=[None, None])
    with torch.device("meta"):
        if args.kind == "flux-dev":
            blocks = tuple(int(b) for b in args.blocks.split(",")) if args.blocks else None
            index["_class_name"], components = flux_dev(FLUX_TINY if args.tiny else FLUX_DEV, blocks, token_ids,
                                                        args.t5_layers)
        elif args.kind == "sdxl":
            index["_class_name"], components = sdxl(args.tiny, token_ids)
        elif token_ids:
            index["_class_name"], components = KINDS[args.kind](token_ids)
        else:
            index["_class_name"], components = KINDS[args.kind]()
    generator = torch.Generator(args.device).manual_seed(args.seed)
    start = time.perf_counter()
    for name, model in components.items():
        folder = os.path.join(args.out, name)
        os.makedirs(folder, exist_ok=True)
        index[name] = [type(model).__module__.split(".")[0], type(model).__name__]
        numel = sum(q.numel() for q in model.parameters())
        line = (f"{name}: {type(model).__name__}, {numel:,} parameters ({numel / 1e9:.3f}B), "
                f"{checkpoint_elements(model) / 1e6:.1f}M elements in its checkpoint")
        if args.random:
            diffusers_model = hasattr(model, "save_config")
            shard_gb = args.shard_gb or (10 if name == "transformer" else 5)
            written = write_random(model, folder, "diffusion_pytorch_model.safetensors" if diffusers_model
                                   else "model.safetensors", int(shard_gb * 1e9), args.device, generator)
            save_config(model, folder)
            line += f"; {written / 1e9:.2f} GB written, {time.perf_counter() - start:.0f} s since the start"
        else:
            write_header_only(model, os.path.join(folder, "model.safetensors"))
        print(line, flush=True)
    with open(os.path.join(args.out, "model_index.json"), "w") as f:
        json.dump(index, f, indent=1)


if __name__ == "__main__":
    main()
