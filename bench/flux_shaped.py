"""A Flux.1-shaped full fine-tune with its CLIP-L text encoder, with fewer blocks than Flux's 19 double + 38 single,
on one GPU capped at --cap-gib, each variant in its own process, to check the memory model on today's shapes where
the whole model does not fit a 64 GB disk and a 10-minute run (issue 30).

The transformer is diffusers' FluxTransformer2DModel with Flux.1-dev's widths (24 heads of 128, joint attention
from T5-XXL's 4096, pooled CLIP 768, guidance embedding), random weights; CLIP-L is transformers' CLIPTextModel with
CLIP-L's config. Both train; T5's output is a fixed random (1, 512, 4096) tensor (T5 is frozen in the scripts).
512 px (1024 image tokens), batch 1, bf16, gradient checkpointing in both models, AdamW at lr 1e-5.

  plain-uncapped    accelerate without DeepSpeed (fp32 weights, bf16 autocast, torch AdamW on the GPU)
  TIER              the fix with a tier of accel_ds_fix.memory.tiers (zero3-offload, zero3-nvme, ...), capped

For each: GPU peaks (allocated/reserved), host peak (ru_maxrss), median step time, losses, and the memory model's
prediction beside them (`plan`'s figure: its activations for Flux at this resolution included).

    python bench/flux_shaped.py --double 2 --single 4 --variants plain-uncapped,zero3-offload --out flux.json
    python bench/flux_shaped.py --tiny --variants zero3-offload --out flux.json     # a smoke test on the CPU
"""

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))
GIB = 1024**3

import variants  # noqa: E402  (bench/variants.py)


def build_models(args):
    import torch
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    if args.tiny:
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=args.double,
                                             num_single_layers=args.single, attention_head_dim=8,
                                             num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                             guidance_embeds=True, axes_dims_rope=(2, 2, 4))
        te_config = CLIPTextConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                                   max_position_embeddings=77, vocab_size=1000, projection_dim=32)
    else:
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=args.double,
                                             num_single_layers=args.single, attention_head_dim=128,
                                             num_attention_heads=24, joint_attention_dim=4096,
                                             pooled_projection_dim=768, guidance_embeds=True,
                                             axes_dims_rope=(16, 56, 56))
        te_config = CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                   num_hidden_layers=12, max_position_embeddings=77, vocab_size=49408)
    text_encoder = CLIPTextModel(te_config)
    transformer.enable_gradient_checkpointing()
    text_encoder.gradient_checkpointing_enable()
    return transformer, text_encoder


def batch(args, g):
    import torch

    tokens = 16 if args.tiny else (args.resolution // 16) ** 2
    channels, joint, text = (4, 32, 8) if args.tiny else (64, 4096, 512)
    side = int(tokens**0.5)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    return {
        "ids": torch.randint(0, 1000 if args.tiny else 49408, (1, 77), generator=g),
        "latents": torch.randn(1, tokens, channels, generator=g),
        "noise": torch.randn(1, tokens, channels, generator=g),
        "t5": torch.randn(1, text, joint, generator=g),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text, 3),
        "t": torch.rand(1, generator=g),
    }


def worker(name, args):
    import torch

    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    if name != "plain-uncapped":
        import accel_ds_fix  # noqa: F401
        if cuda:
            torch.cuda.set_per_process_memory_fraction(args.cap_gib * GIB / torch.cuda.get_device_properties(0).total_memory)
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from train_two_models import single_process_env

    from accel_ds_fix.memory import check, model as memory_model, tiers

    single_process_env()
    result = {"variant": name}
    if name == "plain-uncapped":
        accelerator = Accelerator(mixed_precision="bf16")
    else:
        config = tiers.BY_NAME[name].deepspeed_config(args.nvme_path)
        config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, gradient_clipping=1.0)
        accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    if cuda:
        (torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")).sum().item()
    result["rss_before_models_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    transformer, text_encoder = build_models(args)
    models = (transformer, text_encoder)
    params = [p for m in models for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    result.update(params_m=sum(p.numel() for p in params) / 1e6,
                  largest_m=max(p.numel() for p in params) / 1e6)
    if name != "plain-uncapped":
        work = check.workload_of(models, optimizer)
        settings = memory_model.Settings.from_config(config, "bf16")
        p = memory_model.predict(work, settings, device, host_baseline=0)
        result.update(predicted_gpu_allocated_gib=p.gpu_allocated / GIB, predicted_gpu_reserved_gib=p.gpu_reserved / GIB,
                      predicted_host_above_start_gib=p.host / GIB, predicted_nvme_gib=p.nvme / GIB,
                      predicted_parts=[(w, where, round(b / GIB, 3)) for w, where, b in p.parts])
    g = torch.Generator().manual_seed(1)
    batches = [batch(args, g) for _ in range(args.steps)]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        transformer, text_encoder, optimizer = accelerator.prepare(transformer, text_encoder, optimizer)
        if cuda:
            result.update(prepare_peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                          prepare_peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for b in batches:
            b = {k: v.to(device) for k, v in b.items()}
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with accelerator.autocast():
                pooled = text_encoder(b["ids"]).pooler_output
                pred = transformer(hidden_states=b["latents"] + b["noise"], encoder_hidden_states=b["t5"],
                                   pooled_projections=pooled, timestep=b["t"], img_ids=b["img_ids"],
                                   txt_ids=b["txt_ids"], guidance=torch.full((1,), 3.5, device=device)).sample
            loss = torch.nn.functional.mse_loss(pred.float(), b["noise"].float())
            accelerator.backward(loss)
            if name == "plain-uncapped":
                accelerator.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        result.update(status="ok", step_s=statistics.median(times[1:] or times), times=times, losses=losses)
    except torch.cuda.OutOfMemoryError as exc:
        result.update(status="OOM", error=str(exc).splitlines()[0][:200])
    if cuda:
        result.update(train_peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                      train_peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    Path(args.out).write_text(json.dumps(result))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--double", type=int, default=2, help="double-stream blocks (Flux.1: 19)")
    p.add_argument("--single", type=int, default=4, help="single-stream blocks (Flux.1: 38)")
    p.add_argument("--variants", default="plain-uncapped,zero3-offload")
    p.add_argument("--steps", type=int, default=3, help="steps; the first is not timed")
    p.add_argument("--resolution", type=int, default=512)
    variants.add_arguments(p, cap_gib=16.0, out="flux_shaped.json")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args)
    results = []
    flags = [str(x) for flag in ("double", "single", "steps", "resolution", "cap_gib", "nvme_path")
             for x in ("--" + flag.replace("_", "-"), getattr(args, flag))] + (["--tiny"] if args.tiny else [])
    for r in variants.run_each(__file__, args.variants.split(","), args.out, flags):
        results.append(r)
        name = r["variant"]
        if r["status"].startswith("failed"):
            print(f"{name}: {r['status']}", flush=True)
            continue
        print(f"{name}: {r.get('status')} {r['params_m']:.0f}M params; step {r.get('step_s', 0):.2f} s; GPU allocated "
              f"{r.get('train_peak_allocated_gib', 0):.2f} (prepare {r.get('prepare_peak_allocated_gib', 0):.2f}) / "
              f"reserved {r.get('train_peak_reserved_gib', 0):.2f} GiB, predicted {r.get('predicted_gpu_allocated_gib', 0):.2f}"
              f" / {r.get('predicted_gpu_reserved_gib', 0):.2f} without activations; host {r['peak_rss_gib']:.2f} GiB "
              f"(start {r['rss_before_models_gib']:.2f}), predicted above start {r.get('predicted_host_above_start_gib', 0):.2f};"
              f" losses {r.get('losses')}", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
