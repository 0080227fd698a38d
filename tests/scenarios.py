"""One scenario per process: `python tests/scenarios.py NAME [--reference]`. Prints one JSON line (the last
line of stdout) with what the test checks. Real accelerate + DeepSpeed, CPU, one process."""

import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, set_seed  # noqa: E402
from train_two_models import LATENT, TOKENS, VOCAB, TinyTextEncoder, TinyUNet, single_process_env  # noqa: E402

import accel_ds_fix  # noqa: E402,F401

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def accelerator(zero_stage=2, config=None):
    single_process_env()
    plugin = DeepSpeedPlugin(hf_ds_config=config) if config else DeepSpeedPlugin(zero_stage=zero_stage)
    return Accelerator(deepspeed_plugin=plugin)


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
    acc = accelerator()
    unet, te = TinyUNet(), TinyTextEncoder()
    acc.prepare(unet, te, torch.optim.AdamW(unet.parameters()), torch.optim.AdamW(te.parameters()), data())


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

    def load_hook(models, input_dir):
        seen["load_hook_models"] = len(models)

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


if __name__ == "__main__":
    name, reference = sys.argv[1], "--reference" in sys.argv
    result = SCENARIOS[name](reference)
    print(json.dumps(result))
