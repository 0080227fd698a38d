"""One scenario per process: `python tests/scenarios.py NAME [--reference]`. Prints one JSON line (the last
line of stdout) with what the test checks. Real accelerate + DeepSpeed, CPU, one process."""

import itertools
import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, set_seed  # noqa: E402
from train_two_models import LATENT, TOKENS, VOCAB, WIDTH, TinyTextEncoder, TinyUNet, single_process_env  # noqa: E402

import accel_ds_fix  # noqa: E402,F401

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def accelerator(zero_stage=2, config=None, mixed_precision=None):
    single_process_env()
    plugin = DeepSpeedPlugin(hf_ds_config=config) if config else DeepSpeedPlugin(zero_stage=zero_stage)
    return Accelerator(deepspeed_plugin=plugin, mixed_precision=mixed_precision)


def data(steps=4, batch=2):
    g = torch.Generator().manual_seed(7)
    n = steps * batch
    ds = torch.utils.data.TensorDataset(
        torch.randint(0, VOCAB, (n, TOKENS), generator=g), torch.randn(n, LATENT, generator=g)
    )
    return torch.utils.data.DataLoader(ds, batch_size=batch)


def train(acc, step, optimizer, dataloader, models):
    losses = []
    for ids, latents in dataloader:
        with acc.accumulate(*models):
            loss = torch.nn.functional.mse_loss(step(ids, latents), latents)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class Scale(torch.nn.Module):
    """A model with no parameters at all."""

    def forward(self, x):
        return 0.5 * x


class Together(torch.nn.Module):
    def __init__(self, **models):
        super().__init__()
        self.models = torch.nn.ModuleDict(models)

    def forward(self, ids, latents):
        m = self.models
        out = m["tinyunet"](latents, m["tinytextencoder"](ids))
        return m["scale"](out) if "scale" in m else out


def models_and_optimizer(share=False):
    set_seed(0)
    unet, te = TinyUNet(), TinyTextEncoder()
    if share:
        unet.cond = te.proj  # one parameter in both models
    params = list({id(p): p for p in [*unet.parameters(), *te.parameters()]}.values())
    return unet, te, torch.optim.AdamW(params, lr=1e-2)


def two_model_run(reference, extra=None, share=False):
    acc = accelerator()
    unet, te, opt = models_and_optimizer(share)
    dl = data()
    if reference:
        kw = {"tinyunet": unet, "tinytextencoder": te, **({"scale": extra} if extra else {})}
        merged, opt, dl = acc.prepare(Together(**kw), opt, dl)
        return train(acc, merged, opt, dl, (merged,)), None
    if extra is None:
        unet, te, opt, dl = acc.prepare(unet, te, opt, dl)
        step = lambda ids, lat: unet(lat, te(ids))  # noqa: E731
    else:
        unet, te, extra, opt, dl = acc.prepare(unet, te, extra, opt, dl)
        step = lambda ids, lat: extra(unet(lat, te(ids)))  # noqa: E731
    return train(acc, step, opt, dl, (unet, te)), (unet, te)


@scenario
def shared_params(reference):
    losses, models = two_model_run(reference, share=True)
    result = {"losses": losses}
    if models:
        unet, te = models
        result["still_shared"] = unet.cond.weight is te.proj.weight
    return result


@scenario
def paramless_model(reference):
    losses, _ = two_model_run(reference, extra=Scale())
    return {"losses": losses}


@scenario
def two_optimizers(reference):
    # one engine per optimizer (tests/test_two_optimizers.py); two optimizers over the same parameters cannot be
    acc = accelerator()
    unet, te = TinyUNet(), TinyTextEncoder()
    both = [*unet.parameters(), *te.parameters()]
    acc.prepare(unet, te, torch.optim.AdamW(unet.parameters()), torch.optim.AdamW(both), data())


@scenario
def stray_params(reference):
    acc = accelerator()
    unet, te, vae = TinyUNet(), TinyTextEncoder(), torch.nn.Linear(3, 5)
    opt = torch.optim.AdamW([*unet.parameters(), *te.parameters(), *vae.parameters()])
    acc.prepare(unet, te, opt, data())


@scenario
def sgd_with_offload(reference):
    single_process_env()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu"))
    unet, te = TinyUNet(), TinyTextEncoder()
    acc.prepare(unet, te, torch.optim.SGD([*unet.parameters(), *te.parameters()], lr=0.1), data())


@scenario
def offload_mapping_without_bnb_import(reference):
    # Optimizer offload maps torch's AdamW to DeepSpeedCPUAdam; accelerate imported bitsandbytes (1.5 s) only to
    # ask whether the optimizer is one of its classes. --reference: the script imported bitsandbytes itself.
    if reference:
        import bitsandbytes  # noqa: F401
    single_process_env()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu"))
    set_seed(0)
    unet, te = TinyUNet(), TinyTextEncoder()
    opt = torch.optim.AdamW([*unet.parameters(), *te.parameters()], lr=1e-2, weight_decay=0.1)
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    inner = opt.optimizer.optimizer  # accelerate's wrapper > DeepSpeed's ZeRO optimizer > the CPU optimizer
    return {"bitsandbytes_imported": "bitsandbytes" in sys.modules, "optimizer": type(inner).__name__,
            "adamw_mode": inner.adam_w_mode, "weight_decay": inner.param_groups[0]["weight_decay"],
            "losses": train(acc, lambda ids, lat: unet(lat, te(ids)), opt, dl, (unet, te))}


@scenario
def cpu_adam_with_offload(reference):
    # The script builds DeepSpeed's own CPU optimizer itself (what optimizer offload runs anyway).
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    single_process_env()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu"))
    set_seed(0)
    unet, te = TinyUNet(), TinyTextEncoder()
    opt = DeepSpeedCPUAdam([*unet.parameters(), *te.parameters()], lr=1e-2)
    if reference:
        merged, opt, dl = acc.prepare(Together(tinyunet=unet, tinytextencoder=te), opt, data())
        return {"losses": train(acc, merged, opt, dl, (merged,))}
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    return {"losses": train(acc, lambda ids, lat: unet(lat, te(ids)), opt, dl, (unet, te))}


@scenario
def half_precision_weights(reference):
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(name)s %(levelname)s %(message)s")
    single_process_env()
    acc = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    unet, te, opt = models_and_optimizer()
    unet.to(torch.bfloat16)
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    return {"scaler": repr(acc.scaler)}


@scenario
def already_prepared(reference):
    acc = accelerator()
    unet, te, opt = models_and_optimizer()
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    acc.prepare(unet, te, opt, dl)


@scenario
def model_passed_twice(reference):
    acc = accelerator()
    unet, te, opt = models_and_optimizer()
    acc.prepare(unet, te, unet, opt, data())


@scenario
def merge_line_without_logging(reference):
    # No logging configured at all, as in many training scripts: the merge must still be said (stderr).
    acc = accelerator()
    unet, te, opt = models_and_optimizer()
    acc.prepare(unet, te, opt, data())


@scenario
def zero3_partitioned_at_load(reference):
    # A model created under zero.Init, as transformers does with HfDeepSpeedConfig under ZeRO-3: its
    # parameters are already shape-[0] shards before prepare(); counts must use the full sizes.
    import deepspeed

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(name)s %(message)s")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
    acc = accelerator(config=config)
    set_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        te = TinyTextEncoder()
    shard_numel = sum(p.numel() for p in te.parameters())
    unet = TinyUNet()
    opt = torch.optim.AdamW([*unet.parameters(), *te.parameters()], lr=1e-2)
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    losses = train(acc, lambda ids, lat: unet(lat, te(ids)), opt, dl, (unet, te))
    return {"losses": losses, "shard_numel": shard_numel}


@scenario
def zero3_partitioned_at_load_bf16(reference):
    # kohya's train_db.py: the text encoder comes from transformers, built under zero.Init in bf16 because
    # accelerate keeps a HfDeepSpeedConfig; the UNet is built plainly. The reference builds both plainly.
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}
    acc = accelerator(config=config, mixed_precision="bf16")
    set_seed(0)
    with deepspeed.zero.Init(config_dict_or_path={**config, "bf16": {"enabled": True}}):
        te = TinyTextEncoder()
    unet = TinyUNet()
    if reference:  # the same weights, as a plain fp32 module
        with torch.random.fork_rng(), deepspeed.zero.GatheredParameters(list(te.parameters())):
            plain = TinyTextEncoder()
            plain.load_state_dict({k: v.float() for k, v in te.state_dict().items()})
        te = plain
    opt = torch.optim.AdamW([*unet.parameters(), *te.parameters()], lr=1e-2)
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    losses = train(acc, lambda ids, lat: unet(lat, te(ids)), opt, dl, (unet, te))
    return {"losses": losses, "dtypes": sorted({str(p.dtype) for p in acc._models[0].parameters()})}


@scenario
def zero3_low_cpu_mem_usage(reference):
    # diffusers' pipeline loader passes low_cpu_mem_usage=True to each transformers model; transformers < 4.51
    # refuses it under a ZeRO-3 config (kohya's January 2023 train_db.py (bf691aef) with diffusers 0.25 under a ZeRO-3 tier).
    # --reference: without the fix.
    import tempfile

    import deepspeed
    from transformers import CLIPTextConfig, CLIPTextModel

    folder = tempfile.mkdtemp()
    set_seed(0)
    saved = CLIPTextModel(CLIPTextConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=TOKENS, projection_dim=16))
    saved.save_pretrained(folder)
    accelerator(config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                        "zero_optimization": {"stage": 3}})
    if reference:
        accel_ds_fix.uninstall()
    try:
        model = CLIPTextModel.from_pretrained(folder, low_cpu_mem_usage=True)
    except ValueError as e:
        return {"error": str(e)}
    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        equal = all(torch.equal(p.data, saved.get_parameter(name).data) for name, p in params.items())
    return {"partitioned": all(hasattr(p, "ds_id") for p in params.values()), "equal": equal, "count": len(params)}


def _save_flux_text_encoders(folder):
    """A tiny CLIP and T5 saved whole, as a pipeline folder holds them."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    set_seed(0)
    CLIPTextModel(CLIPTextConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=TOKENS, projection_dim=WIDTH,
                                 eos_token_id=VOCAB - 1)).save_pretrained(f"{folder}/clip")
    t5 = T5EncoderModel(T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=24, num_layers=1, num_heads=2,
                                 relative_attention_num_buckets=8))
    t5.save_pretrained(f"{folder}/t5")
    return t5.eval()  # as from_pretrained returns it (no dropout)


@scenario
def zero3_frozen_unprepared(reference):
    # diffusers' Flux scripts: CLIP and T5 come from from_pretrained, which under accelerate's ZeRO-3 config builds
    # them as shards; CLIP is trained (prepared beside the transformer), T5 is frozen and never prepared. It encodes
    # the prompts in the loop (--train_text_encoder), or with --used-before-prepare once before prepare(), in the
    # dtype the script's .to() asks (fp32 here, the shards being bf16).
    import tempfile

    import deepspeed
    from transformers import CLIPTextModel, T5EncoderModel

    before = "--used-before-prepare" in sys.argv
    folder = tempfile.mkdtemp()
    plain_t5 = _save_flux_text_encoders(folder)
    saved = {k: v.clone() for k, v in plain_t5.state_dict().items()}  # the checkpoint, as written
    dtype = torch.float32 if before else torch.bfloat16
    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # the loaded weights are the checkpoint's in bf16 (the config's), then in `dtype`
        expected = plain_t5.to(torch.bfloat16).to(dtype)(ids)[0]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}
    acc = accelerator(config=config, mixed_precision="bf16")
    t5 = T5EncoderModel.from_pretrained(f"{folder}/t5").requires_grad_(False).to(dtype=dtype)
    clip = CLIPTextModel.from_pretrained(f"{folder}/clip")
    loaded_partitioned = all(hasattr(p, "ds_id") for p in [*t5.parameters(), *clip.parameters()])
    with deepspeed.zero.GatheredParameters(list(clip.parameters())):
        clip_at_start = {n: p.detach().clone() for n, p in clip.named_parameters()}
    outputs = {}
    if before:
        with torch.no_grad():
            outputs["before_prepare"] = t5(ids)[0]
    unet = TinyUNet()
    opt = torch.optim.AdamW([*unet.parameters(), *clip.parameters()], lr=1e-2)
    unet, clip, opt, dl = acc.prepare(unet, clip, opt, data())
    whole_after_prepare = not any(hasattr(p, "ds_id") for p in t5.parameters())

    def step(ids, latents):
        with torch.no_grad():
            prompt_embeds = t5(ids)[0]
        return unet(latents, clip(ids)[0] + prompt_embeds.to(torch.bfloat16))

    losses = train(acc, step, opt, dl, (unet, clip))
    with torch.no_grad():
        outputs["after_training"] = t5(ids)[0]
    with deepspeed.zero.GatheredParameters(list(clip.parameters())):
        clip_changed = sum(not torch.equal(p, clip_at_start[n]) for n, p in acc.unwrap_model(clip).named_parameters())
    # the scripts reload the pipeline after training to save it: what save_pretrained writes is its state_dict
    # (built whole, as without DeepSpeed: in the checkpoint's dtype, and with no collective to wait in)
    reloaded = T5EncoderModel.from_pretrained(f"{folder}/t5").state_dict()
    reload_equal = reloaded.keys() == saved.keys() and all(torch.equal(reloaded[k], saved[k]) for k in saved)
    return {"losses": losses, "loaded_partitioned": loaded_partitioned, "whole_after_prepare": whole_after_prepare,
            "reloaded_after_training_equal": reload_equal,
            "reloaded_devices": sorted({str(t.device) for t in reloaded.values()}),
            "t5_dtypes": sorted({str(p.dtype) for p in t5.parameters()}),
            "t5_output_diff": {k: (v - expected).abs().max().item() for k, v in outputs.items()},
            "clip_changed": clip_changed, "clip_tensors": len(clip_at_start)}


@scenario
def zero3_held_move(reference):
    # diffusers' LoRA scripts under ZeRO-3 with offloaded weights: transformer.to(accelerator.device,
    # dtype=weight_dtype) on the frozen base before prepare(), and the same for a frozen model never prepared. The
    # meta device stands in for the card (a move there keeps no values): a held move keeps the weights in host
    # memory for prepare() to partition, and the unprepared model goes where its .to() asked at prepare().
    # --reference: no .to() at all.
    from transformers import CLIPTextConfig, CLIPTextModel

    def clip(seed):
        set_seed(seed)
        return CLIPTextModel(CLIPTextConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=TOKENS,
                                            eos_token_id=VOCAB - 1))

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "bf16": {"enabled": "auto"}}
    acc = accelerator(config=config, mixed_precision="bf16")
    set_seed(0)
    unet, trained, frozen = TinyUNet(), clip(1), clip(2).requires_grad_(False)
    seen = {}
    if not reference:
        trained.to("meta", dtype=torch.bfloat16)
        frozen.to(torch.device("meta"))
        seen["held"] = {name: sorted({str(p.device) for p in m.parameters()}) for name, m in
                        (("trained", trained), ("frozen", frozen))}
        seen["held_dtypes"] = sorted({str(p.dtype) for p in trained.parameters()})
        # what the script sends to a held model follows its .device (kohya: img_tensors.to(vae.device))
        seen["held_reports"] = [str(trained.device), str(frozen.device)]
        # used before prepare() as kohya caches latents: its input sent to .device, then a forward
        used = clip(4).requires_grad_(False)
        used.to("meta")
        with torch.no_grad():
            out = used(torch.ones(1, TOKENS, dtype=torch.long).to(used.device))[0]
        seen["used_before_prepare"] = [str(out.device), sorted({str(p.device) for p in used.parameters()})]
    opt = torch.optim.AdamW([*unet.parameters(), *trained.parameters()], lr=1e-2)
    unet, trained, opt, dl = acc.prepare(unet, trained, opt, data())
    seen["frozen_after_prepare"] = sorted({str(p.device) for p in frozen.parameters()})
    seen["reports_after_prepare"] = str(frozen.device)
    seen["losses"] = train(acc, lambda ids, latents: unet(latents, trained(ids)[0]), opt, dl, (unet, trained))
    after = clip(3)
    after.to("meta")  # after prepare(): moved at once
    seen["moved_after_prepare"] = sorted({str(p.device) for p in after.parameters()})
    return seen


@scenario
def load_hook_with_deepspeed_branch(reference):
    # diffusers' train_dreambooth_lora_sd3.py: under DeepSpeed its load hook rebuilds the text encoder from the base
    # model, without the LoRA adapter the prepared one has, and loads the checkpoint's LoRA weights into that copy.
    import tempfile

    from accelerate import DistributedType
    from peft import set_peft_model_state_dict
    from transformers import CLIPTextModel

    folder = tempfile.mkdtemp()
    _save_flux_text_encoders(folder)
    acc = accelerator()

    def load_model_hook(models, input_dir):
        if acc.distributed_type == DistributedType.DEEPSPEED:
            rebuilt = CLIPTextModel.from_pretrained(f"{folder}/clip")
            set_peft_model_state_dict(rebuilt, {}, adapter_name="default")

    acc.register_load_state_pre_hook(load_model_hook)
    unet, te, opt = models_and_optimizer()
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    train(acc, lambda ids, lat: unet(lat, te(ids)), opt, dl, (unet, te))
    acc.save_state(f"{folder}/checkpoint")
    saved = [p.detach().clone() for p in [*unet.parameters(), *te.parameters()]]
    train(acc, lambda ids, lat: unet(lat, te(ids)), opt, dl, (unet, te))
    acc.load_state(f"{folder}/checkpoint")
    return {"restored": all(torch.equal(p, s) for p, s in zip([*unet.parameters(), *te.parameters()], saved))}


@scenario
def bnb_8bit_with_offload(reference):
    # bitsandbytes' AdamW8bit under optimizer offload: refused by default (accelerate would swap it for
    # DeepSpeedCPUAdam); with "zero_force_ds_cpu_optimizer": false DeepSpeed steps it on the CPU copy.
    import bitsandbytes as bnb

    single_process_env()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    if "--not-forced" in sys.argv:
        config["zero_force_ds_cpu_optimizer"] = False
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    unet, te, _ = models_and_optimizer()
    opt = bnb.optim.AdamW8bit([*unet.parameters(), *te.parameters()], lr=1e-2, min_8bit_size=16)
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    losses = train(acc, lambda ids, lat: unet(lat, te(ids)), opt, dl, (unet, te))
    inner = acc._models[0].optimizer.optimizer
    state_dtypes = sorted({str(v.dtype) for st in inner.state.values() for v in st.values() if torch.is_tensor(v)})
    return {"losses": losses, "optimizer": type(inner).__name__, "state_dtypes": state_dtypes}


@scenario
def offload_threads(reference):
    single_process_env()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu"))
    unet, te, opt = models_and_optimizer()
    acc.prepare(unet, te, opt, data())
    return {"threads": torch.get_num_threads()}


@scenario
def too_large_for_host(reference):
    # 3 billion parameters on the meta device: nothing is allocated, but DeepSpeed's host buffers would need
    # about 50 GiB under ZeRO-2 + CPU offload, more than this machine has.
    single_process_env()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu"))
    with torch.device("meta"):
        unet, te = torch.nn.Linear(50000, 50000), torch.nn.Linear(10000, 50000)
    opt = torch.optim.AdamW([*unet.parameters(), *te.parameters()], lr=1e-2)
    acc.prepare(unet, te, opt, data())


@scenario
def nvme_ram_too_large_for_host(reference):
    # The NVMe tier with more of its sub groups kept in RAM (accel_ds_fix.nvme_optimizer_ram_gib) than the host
    # has: 1.8 billion parameters on the meta device, 16 bytes each kept, and argv[2] the swap folder.
    single_process_env()
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "sub_group_size": 100_000_000,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[2]}},
              "accel_ds_fix": {"nvme_optimizer_ram_gib": 64}}
    acc = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    with torch.device("meta"):
        unet, te = torch.nn.Linear(30000, 30000), torch.nn.Linear(30000, 30000)
    opt = torch.optim.AdamW([*unet.parameters(), *te.parameters()], lr=1e-2)
    acc.prepare(unet, te, opt, data())


@scenario
def load_short_of_memory(reference):
    # ZeRO-2 + CPU offload saves to argv[2]; loading it back where the host had less room than this process's Adam
    # states (copied out of the mapped ZeRO file) is stopped before anything loads; with that room it loads.
    from accel_ds_fix.checkpoints import load_memory
    from accel_ds_fix.errors import CheckpointError
    from accel_ds_fix.lookup import merged_engines

    single_process_env()
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu"))
    unet, te, opt = models_and_optimizer(False)
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    ids, lat = next(iter(dl))
    acc.backward(torch.nn.functional.mse_loss(unet(lat, te(ids)), lat))
    opt.step()
    acc.save_state(sys.argv[2])
    engine = merged_engines(acc)[0]
    size = load_memory.states_bytes(engine)  # the Adam states copied out of the mapped file
    try:
        load_memory.check(engine, sys.argv[2], "pytorch_model", available=size - 1)
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    load_memory.check(engine, sys.argv[2], "pytorch_model", available=size)
    acc.load_state(sys.argv[2])
    return {"refused": refused, "size": size, "trained": sum(p.numel() for p in [*unet.parameters(), *te.parameters()])}


def after_one_backward():
    """The merged models after one accelerator.backward (argv[2]: the ZeRO stage); gives the accelerator and the
    text encoder, whose embedding gradients the scenarios below read."""
    acc = accelerator(zero_stage=int(sys.argv[2]))
    unet, te, opt = models_and_optimizer()
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    ids, latents = next(iter(dl))
    acc.backward(torch.nn.functional.mse_loss(unet(latents, te(ids)), latents))
    return acc, te


@scenario
def grad_read_after_backward(reference):
    # Textual-inversion-style scripts mask the gradient of every embedding row but the new token's.
    acc, te = after_one_backward()
    if "--safe" in sys.argv:  # what the explanation recommends instead
        from deepspeed.utils import safe_get_full_grad

        full = safe_get_full_grad(acc.unwrap_model(te).embed.weight)
        return {"shape": list(full.shape), "nonzero": bool(full.abs().sum() > 0)}
    grads = acc.unwrap_model(te).embed.weight.grad
    grads[1:] = 0  # fails: under ZeRO-2/3 DeepSpeed holds the gradients


@scenario
def grad_read_into_variable_earlier(reference):
    # diffusers' train_custom_diffusion.py --modifier_token: the gradient is read into a variable, the rows to
    # keep are computed over several lines, then `grads_text_encoder.data[index, :] = ...` dies under ZeRO-2/3.
    acc, te = after_one_backward()
    if acc.num_processes > 1:
        grads_text_encoder = te.module.embed.weight.grad
    else:
        grads_text_encoder = te.embed.weight.grad
    # Get the index for tokens that we want to zero the grads for
    modifier_token_id = [3, 5]
    index_grads_to_zero = torch.arange(VOCAB) != modifier_token_id[0]
    for i in range(1, len(modifier_token_id)):
        index_grads_to_zero = index_grads_to_zero & (
            torch.arange(VOCAB) != modifier_token_id[i]
        )
    grads_text_encoder.data[index_grads_to_zero, :] = grads_text_encoder.data[
        index_grads_to_zero, :
    ].fill_(0)


@scenario
def masked_gradient_rows(reference):
    # The way out for scripts that mask gradients: a hook on the parameter, registered before prepare(),
    # changes the gradient before DeepSpeed takes it (accelerator.backward() also steps under DeepSpeed).
    acc = accelerator(zero_stage=int(sys.argv[2]))
    unet, te, _ = models_and_optimizer()
    keep = torch.zeros(VOCAB, 1)
    keep[2] = 1.0  # only the "new token" row (one the data uses) trains
    if "--no-hook" not in sys.argv:
        te.embed.weight.register_hook(lambda grad: grad * keep)
    before = te.embed.weight.detach().clone()
    opt = torch.optim.AdamW([*unet.parameters(), *te.parameters()], lr=1e-2, weight_decay=0.0)
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    train(acc, lambda ids, lat: unet(lat, te(ids)), opt, dl, (unet, te))
    after = acc.get_state_dict(te)["embed.weight"].float()
    moved = (after - before).abs().sum(dim=1) > 0
    return {"rows_changed": [int(i) for i in torch.nonzero(moved).flatten()]}


@scenario
def restored_weight_rows(reference):
    # Textual inversion restores every embedding row but the new token's after each step. Under ZeRO the
    # optimizer's fp32 copy is what trains: write it with safe_set_full_fp32_param (a collective).
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    acc = accelerator(zero_stage=int(sys.argv[2]))
    unet, te, opt = models_and_optimizer()
    before = te.embed.weight.detach().clone()
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    weight = acc.unwrap_model(te).embed.weight
    for ids, latents in dl:
        acc.backward(torch.nn.functional.mse_loss(unet(latents, te(ids)), latents))
        opt.step()
        opt.zero_grad()
        full = safe_get_full_fp32_param(weight)
        full[torch.arange(VOCAB) != 2] = before[torch.arange(VOCAB) != 2]
        safe_set_full_fp32_param(weight, full)
    after = safe_get_full_fp32_param(weight)  # the trained copy; the module's weights follow at the next step
    moved = (after - before).abs().sum(dim=1) > 0
    return {"rows_changed": [int(i) for i in torch.nonzero(moved).flatten()]}


@scenario
def weight_write_outside_forward(reference):
    acc = accelerator(zero_stage=3)
    unet, te, opt = models_and_optimizer()
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    with torch.no_grad():
        acc.unwrap_model(te).embed.weight[2] = 0.0  # a shape-[0] shard under ZeRO-3


@scenario
def textual_inversion(reference):
    # The textual inversion scripts' pattern (diffusers' textual_inversion.py, the advanced DreamBooth scripts'
    # retract_embeddings): a CLIP text encoder with only its input embedding trainable, prepared beside a UNet;
    # after each step every row but the new token's is put back by a write to the weight. argv[2]: the ZeRO stage;
    # ZeRO-3 with every weight partitioned, as CLIP-L's 38M-element embedding is at real size.
    from transformers import CLIPTextConfig, CLIPTextModel

    stage = int(sys.argv[2])
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    acc = accelerator(config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                              "zero_optimization": zero})
    if reference:
        accel_ds_fix.uninstall()
    set_seed(0)
    unet = TinyUNet()
    te = CLIPTextModel(CLIPTextConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=TOKENS, projection_dim=WIDTH))
    te.requires_grad_(False)
    te.get_input_embeddings().weight.requires_grad_(True)
    original = te.get_input_embeddings().weight.detach().clone()
    opt = torch.optim.AdamW([*unet.parameters(), te.get_input_embeddings().weight], lr=1e-2)
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    keep = torch.arange(VOCAB) != 2  # the new token's row trains
    losses = []
    for ids, latents in dl:
        loss = torch.nn.functional.mse_loss(unet(latents, te(ids).last_hidden_state), latents)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            acc.unwrap_model(te).get_input_embeddings().weight[keep] = original[keep]
        losses.append(loss.item())
    return {"losses": losses}


@scenario
def save_after_end_training(reference):
    # kohya's train_db.py / train_network.py: accelerator.end_training(), then the final save_state and model save.
    acc = accelerator(zero_stage=int(sys.argv[2]))
    unet, te, opt = models_and_optimizer()
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    train(acc, lambda ids, lat: unet(lat, te(ids)), opt, dl, (unet, te))
    acc.end_training()
    acc.save_state(sys.argv[3])
    state = acc.get_state_dict(te)
    return {"saved": sorted(os.listdir(sys.argv[3])), "te_shapes": [list(v.shape) for v in state.values()][:2]}


class ReadsEmbeddingRows(TinyTextEncoder):
    """transformers' CLIP embeddings: the forward reads a child's weight (its row count) before calling the child."""

    def forward(self, input_ids):
        rows = self.embed.weight.shape[0]
        if input_ids.shape[-1] > rows:
            raise ValueError(f"Sequence length must be less than max_position_embeddings ({rows})")
        return super().forward(input_ids)


@scenario
def wrapper_called_in_parts(reference):
    # kohya's --deepspeed (sdxl_train.py, train_db.py): its models go into one wrapper module for prepare(); each
    # model is then called on its own, never the engine, and saved on its own after accelerator.end_training(),
    # on the main process alone (as kohya saves) where `accelerate launch --num_processes 2` started two.
    # --reference: the engine called with the whole step, its weights read by accelerate's get_state_dict on
    # every process.
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if several:  # on the CPU, accelerate would give each DeepSpeed process a world of its own
        from accelerate import PartialState

        PartialState(backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True}}
    acc = accelerator(config=config)
    set_seed(0)
    unet, te = TinyUNet(), ReadsEmbeddingRows()

    def each_models_state():  # as kohya saves: the state_dict() of each model on its own
        return {f"{name}.{k}": v for name, m in (("tinyunet", unet), ("tinytextencoder", te))
                for k, v in m.state_dict().items()}

    initial = {k: v.clone() for k, v in each_models_state().items()}
    te.norm.requires_grad_(False)  # kohya freezes CLIP-L's last layer, and saves it with the model
    wrapper = Together(tinyunet=unet, tinytextencoder=te)
    trained = [p for p in wrapper.parameters() if p.requires_grad]
    engine, opt, dl = acc.prepare(wrapper, torch.optim.AdamW(trained, lr=1e-2), data(steps=5))
    step = engine if reference else (lambda ids, lat: unet(lat, te(ids)))
    losses = train(acc, step, opt, dl, (engine,))
    acc.wait_for_everyone()
    acc.end_training()
    if reference:
        whole = acc.get_state_dict(engine) or {}  # (the main process's, None on the others)
        state = {k.removeprefix("models."): v for k, v in whole.items()}
    elif acc.is_main_process:
        state = each_models_state()
    else:
        state = {}
    return {"losses": losses, "weights": {k: v.flatten().tolist() for k, v in state.items()},
            "changed": sorted(k for k, v in state.items() if not torch.equal(v, initial[k]))}


@scenario
def single_model_hooks(reference):
    # Nothing merged: hooks are registered and called exactly as without the package.
    acc = accelerator()
    seen = {}

    def save_hook(models, weights, output_dir):
        seen["models_is_accelerators_list"] = models is acc._models
        seen["weights"] = len(weights)

    acc.register_save_state_pre_hook(save_hook)
    seen["stored_is_users_function"] = list(acc._save_model_state_pre_hook.values()) == [save_hook]
    unet = TinyUNet()
    engine, opt, dl = acc.prepare(unet, torch.optim.AdamW(unet.parameters()), data())
    acc.save_state(sys.argv[2])
    return seen


@scenario
def one_model(reference):
    acc = accelerator()
    unet = TinyUNet()
    engine, opt, dl = acc.prepare(unet, torch.optim.AdamW(unet.parameters()), data())
    return {"type": type(engine).__name__, "patched": accel_ds_fix.is_installed()}


@scenario
def not_deepspeed(reference):
    acc = Accelerator(cpu=True)
    unet, te, opt = models_and_optimizer()
    unet_p, te_p, opt, dl = acc.prepare(unet, te, opt, data())
    losses = train(acc, lambda ids, lat: unet_p(lat, te_p(ids)), opt, dl, (unet_p, te_p))
    return {"types": [type(unet_p).__name__, type(te_p).__name__], "same": [unet_p is unet, te_p is te],
            "losses": losses}


@scenario
def auto_bucket_sizes(reference):
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    acc = accelerator(config=config)
    unet, te, opt = models_and_optimizer()
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    losses = train(acc, lambda ids, lat: unet(lat, te(ids)), opt, dl, (unet, te))
    zero = acc.deepspeed_config["zero_optimization"]
    return {"reduce_bucket_size": zero["reduce_bucket_size"], "losses": losses}


@scenario
def proxy_behaviour(reference):
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(name)s %(message)s")
    acc = accelerator()
    unet_m, te_m, opt = models_and_optimizer()
    unet, te, opt, dl = acc.prepare(unet_m, te_m, opt, data())
    te_train = te.eval()
    unet.marker = 42
    ids, latents = next(iter(dl))
    return {
        "isinstance": [isinstance(unet, TinyUNet), isinstance(te, TinyTextEncoder), isinstance(unet, torch.nn.Module)],
        "attribute_is_original": unet.inp is unet_m.inp,
        "setattr_reaches_model": getattr(unet_m, "marker", None) == 42,
        "eval_returns_proxy": te_train is te,
        "training": [unet.training, te.training],
        "unwrap": accel_ds_fix.unwrap(unet) is unet_m,
        "param_count": sum(p.numel() for p in unet.parameters()) == sum(p.numel() for p in unet_m.parameters()),
        "output_shape": list(unet(latents, te(ids)).shape),
    }


@scenario
def resume_other_models(reference):
    acc = accelerator()
    set_seed(0)
    unet, other = TinyUNet(), torch.nn.Linear(4, 4)
    unet, other, opt, dl = acc.prepare(unet, other, torch.optim.AdamW([*unet.parameters(), *other.parameters()]), data())
    acc.load_state(sys.argv[2])


@scenario
def hooks_and_helpers(reference):
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    acc = accelerator()
    seen = {}

    def save_hook(models, weights, output_dir):
        seen["save_hook_models"] = [m.__class__.__name__ for m in models]
        seen["save_hook_isinstance"] = [isinstance(models[0], TinyUNet), isinstance(models[1], TinyTextEncoder)]
        seen["save_hook_unwraps"] = [acc.unwrap_model(m) is orig for m, orig in zip(models, originals)]
        seen["save_hook_weights"] = len(weights)

    def load_hook(models, input_dir):
        seen["load_hook_models"] = [m.__class__.__name__ for m in models]

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    unet, te, opt = models_and_optimizer()
    originals = (unet, te)
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    for ids, latents in dl:
        acc.backward(torch.nn.functional.mse_loss(unet(latents, te(ids)), latents))
        norm = acc.clip_grad_norm_([*unet.parameters(), *te.parameters()], 0.5)
        acc.clip_grad_norm_([*unet.parameters(), *te.parameters()], 0.5)
        opt.step()
        opt.zero_grad()
    acc.save_state(sys.argv[2])
    acc.load_state(sys.argv[2])
    seen["grad_norm_is_number"] = isinstance(float(norm), float)
    returned = acc.free_memory(unet, te, opt)
    seen["freed"] = {"models": len(acc._models), "engine_wrapped": acc.deepspeed_engine_wrapped,
                     "returned": list(returned)}
    return seen



@scenario
def clip_by_the_scripts_norm(reference):
    # diffusers' LoRA scripts (train_dreambooth_lora_flux.py --train_text_encoder): the text encoder's embedding,
    # frozen and outside the optimizer, is made trainable after prepare() (for gradient checkpointing), and the
    # script clips chain(unet.parameters(), text_encoder.parameters()) to max_norm (argv[3]) each step, with a
    # decaying learning rate. The reference is plain accelerate without DeepSpeed. argv[2]: "2", "2-offload", "3", "1".
    stage, _, offload = sys.argv[2].partition("-")
    max_norm = float(sys.argv[3])
    if reference:
        accel_ds_fix.uninstall()
        acc = Accelerator(cpu=True)
    else:
        zero = {"stage": int(stage)}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        acc = accelerator(config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                  "gradient_clipping": "auto", "zero_optimization": zero,
                                  "zero_force_ds_cpu_optimizer": False})
    set_seed(0)
    unet, te = TinyUNet(), TinyTextEncoder()
    te.embed.requires_grad_(False)
    opt = torch.optim.AdamW([*unet.parameters(), *(p for n, p in te.named_parameters() if not n.startswith("embed"))],
                            lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.5 * step))
    unet, te, opt, dl, scheduler = acc.prepare(unet, te, opt, data(steps=6), scheduler)
    acc.unwrap_model(te).embed.requires_grad_(True)
    losses, norms = [], []
    for ids, latents in dl:
        loss = torch.nn.functional.mse_loss(unet(latents, te(ids)), latents)
        acc.backward(loss)
        norms.append(float(acc.clip_grad_norm_(itertools.chain(unet.parameters(), te.parameters()), max_norm)))
        opt.step()
        scheduler.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {}
    for name, model in (("unet", unet), ("te", te)):
        state = acc.get_state_dict(model)
        weights.update({f"{name}.{k}": v.float().flatten().tolist() for k, v in state.items()})
    return {"losses": losses, "norms": norms, "weights": weights}


@scenario
def null_sections(reference):
    # A DeepSpeed config with null sections (JSON null), as DeepSpeed itself takes them: two models merged, trained;
    # the reference trains the hand-written merge of the same models.
    from train_two_models import HandMerged

    zero = {"stage": 2, "offload_param": None}
    if "--null-optimizer-offload" in sys.argv:  # accelerate's own prepare() reads this one with .get()
        zero["offload_optimizer"] = None
    acc = accelerator(config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                              "zero_optimization": zero})
    set_seed(0)
    unet, te = TinyUNet(), TinyTextEncoder()
    if reference:
        merged = HandMerged(te, unet)
        opt = torch.optim.AdamW(merged.parameters(), lr=1e-2)
        merged, opt, dl = acc.prepare(merged, opt, data())
        return {"losses": train(acc, lambda ids, lat: merged(ids, lat), opt, dl, (merged,))}
    opt = torch.optim.AdamW([*unet.parameters(), *te.parameters()], lr=1e-2)
    unet, te, opt, dl = acc.prepare(unet, te, opt, data())
    return {"losses": train(acc, lambda ids, lat: unet(lat, te(ids)), opt, dl, (unet, te))}


@scenario
def one_model_auto_buckets(reference):
    # accelerate's own test_autofill_comm_buffers_dsconfig, replayed on the CPU (bf16): one model under a ZeRO-3
    # config whose bucket sizes are "auto". accelerate fills them from model.config, and says so where it cannot;
    # the fix used to partition the model first, and DeepSpeed's error came instead (issue 41, item 7).
    if reference:
        accel_ds_fix.uninstall()

    class Config:  # a model.config without a hidden size
        pass

    class Regression(torch.nn.Module):  # accelerate's RegressionModel: two scalar (0-dim) parameters
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Parameter(torch.tensor(2.0)), torch.nn.Parameter(torch.tensor(3.0))

        def forward(self, x):
            return x * self.a + self.b

    outcomes = {}
    for kind in ("no config", "config without hidden size", "config with hidden size"):
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                        "stage3_prefetch_bucket_size": "auto",
                                        "stage3_param_persistence_threshold": "auto"}}
        acc = accelerator(config=config, mixed_precision="bf16")
        model = TinyUNet() if kind == "config with hidden size" else Regression()  # DeepSpeed partitions no 0-dim bf16
        if kind != "no config":
            model.config = Config()
        if kind == "config with hidden size":
            model.config.hidden_size = WIDTH
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        try:
            engine, opt = acc.prepare(model, opt)
        except ValueError as exc:
            outcomes[kind] = f"ValueError: {exc}"
        else:
            zero = acc.deepspeed_config["zero_optimization"]
            outcomes[kind] = {"reduce_bucket_size": zero["reduce_bucket_size"],
                              "partitioned": all(hasattr(p, "ds_id") for p in engine.module.parameters())}
        acc.free_memory()
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
    return outcomes

if __name__ == "__main__":
    name, reference = sys.argv[1], "--reference" in sys.argv
    result = SCENARIOS[name](reference)
    print(json.dumps(result))
