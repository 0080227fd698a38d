"""SD1.5-architecture DreamBooth step (UNet + CLIP-L text encoder, random weights, 512 px, batch 1, fp16,
gradient checkpointing, AdamW at lr 1e-6) on one GPU capped at --cap-gib, each variant in its own process:

  plain             accelerate without DeepSpeed, torch AdamW          (expected: OOM under a 6 GiB cap)
  plain-uncapped    the same without the cap, for its real peak
  hand              a hand-written merged module, accelerate's default ZeRO-2 + CPU optimizer offload
  hand-gc           the same with PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6
  fix               prepare(unet, text_encoder, ...) with accel_ds_fix, the same config as `hand`
  zero2-offload     the fix with the shipped tier of that name (configs/); zero3-offload, zero3-nvme likewise
  zero2-fp16-master zero2-offload with fp16 master weights and gradients (DeepSpeed's fp16_master_weights_and_grads)
  lora              LoRA rank 8 on UNet + text encoder (peft), frozen fp16 base, plain accelerate, torch AdamW
  lora-zero2        the same LoRA through the fix under ZeRO-2 (no offload)
  lora-network      kohya's January 2023 train_network.py shape (tests/kohya_lora.py): a LoRA network module of its
                    own (rank 8, alpha 1, 192 UNet + 72 text-encoder layers patched), prepare(unet, text_encoder,
                    network, ...) with only the network in the optimizer, the UNet and text encoder frozen after
                    prepare() (UNet cast to fp16 then, as kohya does), plain accelerate; at the end the network is
                    saved as kohya saves it (state_dict() through safetensors' save_file, no save precision)
  lora-network-zero2-offload  the same through the fix with the zero2-offload tier

For each: peak GPU memory (allocated/reserved, split into engine construction and training), peak host RSS,
the memory model's prediction beside them, median step time, losses, and how many weight tensors (and
elements) changed from their initial fp16 values: at lr 1e-6, fp16 master weights round most updates away.

    python bench/sd15_6gb.py --variants zero2-offload,zero3-nvme,zero3-offload --nvme-path /mnt/nvme/x --out r.json
    python bench/sd15_6gb.py --tiny --variants zero2-offload --out r.json    # a smoke test on the CPU
    python bench/sd15_6gb.py --variants lora-network,lora-network-zero2-offload --lr 1e-4 --out lora.json
"""

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
GIB = 1024**3

import variants  # noqa: E402  (bench/variants.py)
# name: (how the models are prepared, tier name / "default" / None, capped, extra environment)
VARIANTS = {
    "plain": ("plain", None, True, {}),
    "plain-uncapped": ("plain", None, False, {}),
    "hand": ("hand", "default", True, {}),
    "hand-gc": ("hand", "default", True, {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}),
    "fix": ("fix", "default", True, {}),
    "zero2-offload": ("fix", "zero2-offload", True, {}),
    "zero2-fp16-master": ("fix", "zero2-fp16-master", True, {}),
    "zero3-offload": ("fix", "zero3-offload", True, {}),
    "zero3-nvme": ("fix", "zero3-nvme", True, {}),
    "zero3-nvme-unpinned": ("fix", "zero3-nvme-unpinned", True, {}),
    "zero3-nvme-params-cpu": ("fix", "zero3-nvme-params-cpu", True, {}),
    "zero3-gpu-params": ("fix", "zero3-gpu-params", True, {}),
    "lora": ("lora", None, True, {}),
    "lora-zero2": ("lora-fix", "zero2", True, {}),
    "lora-network": ("kohya-network", None, True, {}),
    "lora-network-zero2-offload": ("kohya-network-fix", "zero2-offload", True, {}),
}
# Variants that run without the fix (accelerate alone).
WITHOUT_FIX = ("plain", "lora", "kohya-network")


def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def build_models(tiny):
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    if tiny:
        unet = UNet2DConditionModel(sample_size=8, block_out_channels=(32, 64), layers_per_block=1,
                                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                    attention_head_dim=4, norm_num_groups=8)
        te_config = CLIPTextConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                                   max_position_embeddings=77, vocab_size=1000)
    else:
        unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768)  # SD1.5 layout
        te_config = CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                   num_hidden_layers=12, max_position_embeddings=77, vocab_size=49408)
    text_encoder = CLIPTextModel(te_config)
    unet.enable_gradient_checkpointing()
    text_encoder.gradient_checkpointing_enable()
    unet.train()
    text_encoder.train()
    return unet, text_encoder


def hand_merged(unet, text_encoder, device_type, dtype):
    """The by-hand workaround: both models in one module whose forward runs a whole step."""
    import torch

    class HandMerged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.models = torch.nn.ModuleDict({"unet2dconditionmodel": unet, "cliptextmodel": text_encoder})

        def forward(self, ids, noisy, t):
            with torch.autocast(device_type, dtype=dtype):
                hidden = self.models["cliptextmodel"](ids)[0]
                return self.models["unet2dconditionmodel"](noisy, t, hidden).sample

    return HandMerged()


def deepspeed_config(name, nvme_path):
    from accel_ds_fix.memory import tiers

    if name in tiers.BY_NAME:
        return tiers.BY_NAME[name].deepspeed_config(nvme_path)
    if name == "zero2-fp16-master":
        config = tiers.BY_NAME["zero2-offload"].deepspeed_config()
        config["fp16"]["fp16_master_weights_and_grads"] = True
        return config
    if name == "zero3-nvme-unpinned":
        config = tiers.BY_NAME["zero3-nvme"].deepspeed_config(nvme_path)
        config["zero_optimization"]["offload_optimizer"]["pin_memory"] = False
        return config
    if name == "zero3-nvme-params-cpu":  # ZeRO-Infinity's usual layout: weights in RAM, optimizer on NVMe
        config = tiers.BY_NAME["zero3-nvme"].deepspeed_config(nvme_path)
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        return config
    if name == "zero3-gpu-params":  # the NVMe tier's layout with the optimizer in RAM instead
        config = tiers.BY_NAME["zero3-nvme"].deepspeed_config(nvme_path)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        return config
    if name == "zero2":
        config = tiers.BY_NAME["zero2-offload"].deepspeed_config()
        config["zero_optimization"].pop("offload_optimizer")
        return config
    raise ValueError(name)


def save_initial(models, path):
    """Every parameter as fp32, one after another in one file: no second copy of the model in memory."""
    import numpy as np

    with open(path, "wb") as f:
        for model in models:
            for _, p in model.named_parameters():
                p.detach().float().cpu().numpy().astype(np.float32, copy=False).tofile(f)


def changed_from_initial(models, path):
    """(tensors changed, tensors, elements changed, elements) of the trainable weights, compared in the
    precision the model trains them in (gathered under ZeRO-3)."""
    import contextlib

    import numpy as np
    import torch

    tensors, changed, elements, changed_elements = 0, 0, 0, 0
    initial = open(path, "rb")  # plain reads: a memory map would count the whole file in the process's RSS
    for model in models:
        for _, p in model.named_parameters():
            numel = int(getattr(p, "ds_numel", p.numel()))
            start = torch.from_numpy(np.fromfile(initial, dtype=np.float32, count=numel))
            if not p.requires_grad:
                continue
            gather = contextlib.nullcontext()
            if hasattr(p, "ds_id"):
                import deepspeed

                gather = deepspeed.zero.GatheredParameters([p], modifier_rank=None)
            with gather:
                now = p.detach().reshape(-1).cpu()
                differs = now.ne(start.to(now.dtype))
            tensors += 1
            elements += numel
            changed += int(differs.any())
            changed_elements += int(differs.sum())
    initial.close()
    return changed, tensors, changed_elements, elements


def add_lora(unet, text_encoder, rank=8):
    from peft import LoraConfig

    unet.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    text_encoder.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                        target_modules=["q_proj", "k_proj", "v_proj", "out_proj"]))


def kohya_network(unet, text_encoder):
    """kohya's LoRA network for SD1.5, patched into both models (its own forward is never called)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from kohya_lora import LoRANetwork

    network = LoRANetwork.for_stable_diffusion(text_encoder, unet, rank=8, alpha=1.0)
    network.apply_to()
    return network


def freeze_as_kohya(unet, text_encoder, device, half):
    """What train_network.py does right after prepare(): both models frozen, the UNet cast to the training
    precision; with gradient checkpointing the text encoder's embeddings stay trainable, so that its checkpointed
    layers (and their LoRA) get gradients."""
    unet.requires_grad_(False)
    unet.to(device, dtype=half)
    text_encoder.requires_grad_(False)
    text_encoder.to(device)
    getattr(text_encoder, "text_model", text_encoder).embeddings.requires_grad_(True)  # transformers 5: no text_model


def save_as_kohya(network, path, cuda):
    """network.save_weights() without a save precision: its state_dict() straight into safetensors' save_file."""
    import torch
    from safetensors.torch import save_file

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    start = time.perf_counter()
    result = {}
    try:
        network.save_weights(str(path), save_file)
    except RuntimeError as exc:
        result["save_error"] = str(exc).strip().splitlines()[0][:160]
    result.update(save_s=time.perf_counter() - start, saved_mib=path.stat().st_size / 2**20 if path.exists() else 0,
                  peak_rss_after_save_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB)
    if cuda:  # what the save added on the card (the fix copies to the host, one tensor at a time)
        result["save_gpu_extra_gib"] = (torch.cuda.max_memory_allocated() - before) / GIB
    path.unlink(missing_ok=True)
    return result


def worker(name, args):
    import torch

    mode, config_name, capped, _ = VARIANTS[name]
    cuda = torch.cuda.is_available() and not args.tiny
    half = torch.float16 if cuda else torch.bfloat16
    precision = "fp16" if cuda else "bf16"
    if capped and cuda:
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * GIB / torch.cuda.get_device_properties(0).total_memory)
    if mode not in WITHOUT_FIX:
        import accel_ds_fix  # noqa: F401
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from accel_ds_fix.memory import model as memory_model, check as memory_check

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    if config_name is None:
        accelerator = Accelerator(mixed_precision=precision)
    elif config_name == "default":
        plugin = DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu", gradient_clipping=1.0)
        accelerator = Accelerator(mixed_precision=precision, deepspeed_plugin=plugin)
    else:
        config = deepspeed_config(config_name, args.nvme_path)
        accelerator = Accelerator(mixed_precision=precision, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    # What the run imports anyway, before the baseline is read: no part of the models' memory.
    import diffusers  # noqa: F401
    import transformers  # noqa: F401

    if config_name is not None:
        import deepspeed.runtime.engine  # noqa: F401
        import deepspeed.runtime.zero.stage3  # noqa: F401
    if mode.startswith("lora"):
        import peft  # noqa: F401
    if cuda:  # the CUDA context and cuBLAS are the process's too, before any model
        (torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")).sum().item()
    result = {"variant": name, "rss_before_models_gib": rss() / GIB}
    unet, text_encoder = build_models(args.tiny)
    network = None
    if mode.startswith("lora"):
        add_lora(unet, text_encoder)
        if cuda:  # diffusers' LoRA scripts keep the frozen base in the training precision
            for model in (unet, text_encoder):
                for p in model.parameters():
                    if not p.requires_grad:
                        p.data = p.data.to(half)
    if mode.startswith("kohya-network"):
        network = kohya_network(unet, text_encoder)
    models = (unet, text_encoder) if network is None else (unet, text_encoder, network)
    trained = models if network is None else (network,)  # kohya's models are frozen only after prepare()
    initial = Path(args.out).with_suffix(f".{name}.initial.bin")
    save_initial(trained, initial)
    params = [p for m in trained for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params if network is None else network.prepare_optimizer_params(args.lr, args.lr),
                                  lr=args.lr)
    result["params_m"] = sum(p.numel() for m in models for p in m.parameters()) / 1e6
    result["trainable_m"] = sum(p.numel() for p in params) / 1e6
    if config_name is not None:
        work = memory_check.workload_of(models, optimizer)
        work = memory_model.Workload(**{**work.__dict__, "activations": 0 if args.tiny else memory_model.SD15_ACTIVATIONS})
        settings = memory_model.Settings.from_config(accelerator.state.deepspeed_plugin.deepspeed_config, precision)
        p = memory_model.predict(work, settings, "cuda" if cuda else "cpu", host_baseline=0)
        result.update(predicted_gpu_allocated_gib=p.gpu_allocated / GIB, predicted_gpu_reserved_gib=p.gpu_reserved / GIB,
                      predicted_host_gib=(p.host + int(result["rss_before_models_gib"] * GIB)) / GIB,
                      predicted_host_plan_gib=(p.host + memory_model.HOST_BASELINE["cuda" if cuda else "cpu"]) / GIB,
                      predicted_nvme_gib=p.nvme / GIB)
    result["rss_models_built_gib"] = rss() / GIB
    g = torch.Generator().manual_seed(1)
    n = args.steps + 2
    size = 8 if args.tiny else 64
    vocab = 1000 if args.tiny else 49408
    data = torch.utils.data.TensorDataset(
        torch.randint(0, vocab, (n, 77), generator=g), torch.randn(n, 4, size, size, generator=g),
        torch.randn(n, 4, size, size, generator=g), torch.randint(0, 1000, (n,), generator=g),
    )
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        if mode == "hand":
            merged = hand_merged(unet, text_encoder, "cuda" if cuda else "cpu", half)
            merged, optimizer, loader = accelerator.prepare(merged, optimizer, loader)
            forward = merged
        elif network is not None:
            unet, text_encoder, network, optimizer, loader = accelerator.prepare(unet, text_encoder, network, optimizer,
                                                                                 loader)
            freeze_as_kohya(unet, text_encoder, accelerator.device, half)
            trained = (network,)
        else:
            unet, text_encoder, optimizer, loader = accelerator.prepare(unet, text_encoder, optimizer, loader)
            trained = (unet, text_encoder)
        if mode != "hand":

            def forward(ids, noisy, t):
                with accelerator.autocast():
                    return unet(noisy, t, text_encoder(ids)[0]).sample

        result["rss_after_prepare_gib"] = rss() / GIB
        if cuda:
            result.update(prepare_peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                          prepare_peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for ids, latents, noise, t in loader:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            pred = forward(ids, latents + noise, t)
            loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        result.update(status="ok", step_s=statistics.median(times[2:]), losses=losses,
                      peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB)
        c, tensors, ce, elements = changed_from_initial([accelerator.unwrap_model(m) for m in trained]
                                                        if mode != "hand" else [merged.module], initial)
        result.update(changed_tensors=c, trainable_tensors=tensors, changed_elements=ce, trainable_elements=elements)
        if network is not None:
            result.update(save_as_kohya(accelerator.unwrap_model(network),
                                        Path(args.out).with_suffix(f".{name}.safetensors"), cuda))
    except torch.cuda.OutOfMemoryError as exc:
        result.update(status="OOM", error=str(exc).splitlines()[0][:160])
    finally:
        initial.unlink(missing_ok=True)
    if cuda:
        result.update(train_peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                      train_peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
        result.update(peak_allocated_gib=max(result.get("prepare_peak_allocated_gib", 0), result["train_peak_allocated_gib"]),
                      peak_reserved_gib=max(result.get("prepare_peak_reserved_gib", 0), result["train_peak_reserved_gib"]))
    result.setdefault("peak_rss_gib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB)
    result["torch_threads"] = torch.get_num_threads()
    Path(args.out).write_text(json.dumps(result))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="zero2-offload,zero3-nvme,zero3-offload")
    p.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--lr", type=float, default=1e-6)
    variants.add_arguments(p, cap_gib=6.0, out="bench_results.json")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args)

    results = []
    flags = ["--steps", str(args.steps), "--lr", str(args.lr), "--cap-gib", str(args.cap_gib), "--nvme-path",
             args.nvme_path] + (["--tiny"] if args.tiny else [])
    for result in variants.run_each(__file__, args.variants.split(","), args.out, flags,
                                    env_for=lambda name: VARIANTS[name][3]):
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("log", "losses")}), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    report(results)


def report(results):
    nan = float("nan")
    width = max([18] + [len(r["variant"]) + 1 for r in results])
    print(f"\n{'variant':<{width}}{'status':<7}{'alloc':>7}{'reserved':>9}{'pred':>6}{'host':>7}{'pred':>6}"
          f"{'s/step':>8}{'changed tensors':>17}{'elements':>10}")
    for r in results:
        changed = f"{r['changed_tensors']}/{r['trainable_tensors']}" if "changed_tensors" in r else "-"
        elements = f"{r['changed_elements'] / max(r['trainable_elements'], 1):.1%}" if "changed_elements" in r else "-"
        print(f"{r['variant']:<{width}}{r['status'][:6]:<7}{r.get('peak_allocated_gib', nan):>7.2f}"
              f"{r.get('peak_reserved_gib', nan):>9.2f}{r.get('predicted_gpu_reserved_gib', nan):>6.2f}"
              f"{r.get('peak_rss_gib', nan):>7.2f}{r.get('predicted_host_gib', nan):>6.2f}"
              f"{r.get('step_s', nan):>8.3f}{changed:>17}{elements:>10}")


if __name__ == "__main__":
    main()
