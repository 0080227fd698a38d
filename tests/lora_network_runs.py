"""Issue 18's runs, one per process (real accelerate + DeepSpeed, CPU): what a script shaped like kohya's January
2023 train_network.py does, and saving every merged model with an old safetensors.

    python tests/lora_network_runs.py kohya_network --stage 2 --precision bf16 --out DIR --old-safetensors DIR2
    python tests/lora_network_runs.py kohya_network ... --reference    # the hand-written merge, without the fix
    python tests/lora_network_runs.py tied_weights --stage 3 --out DIR --old-safetensors DIR2

Writes its results as JSON to DIR/result.json, and its files into DIR. The fix is active (scenarios.py imports
it); a reference run prepares one module, which the fix leaves to accelerate.
"""

import argparse
import json
import logging
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
from kohya_lora import LoRANetwork  # noqa: E402
from scenarios import Together, accelerator, data, train  # noqa: E402
from train_two_models import VOCAB, WIDTH, TinyTextEncoder, TinyUNet  # noqa: E402

RUNS = {}


def run(fn):
    RUNS[fn.__name__] = fn
    return fn


def old_safetensors_torch(folder):
    """safetensors.torch of the old release installed alone in ``folder``, imported beside the newer release that
    accelerate imports (which stays what ``import safetensors`` gives everyone else): (module, version)."""
    def ours(name):
        return name == "safetensors" or name.startswith("safetensors.")

    newer = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in newer:
        del sys.modules[name]
    sys.path.insert(0, str(folder))
    try:
        import safetensors
        import safetensors.torch as old

        version = safetensors.__version__
    finally:
        sys.path.remove(str(folder))
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(newer)
    return old, version


def storages(state):
    return len({t.untyped_storage().data_ptr() for t in state.values()})


def save_error(save, *args):
    """The first line of what ``save`` raises, or None when it saves."""
    try:
        save(*args)
    except RuntimeError as e:
        return str(e).strip().splitlines()[0].strip()
    return None


def all_equal(state, loaded):
    return sorted(state) == sorted(loaded) and all(torch.equal(state[k].cpu(), loaded[k]) for k in state)


def full_state(module):
    """The module's weights as separate full host tensors, without the fix (gathered under ZeRO-3)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def tiny_lora_network(unet, text_encoder):
    return LoRANetwork([("lora_te_proj", text_encoder.proj)],
                       [(f"lora_unet_{name}", getattr(unet, name)) for name in ("inp", "cond", "out")])


def step_function(prepared, precision):
    def step(ids, latents):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            return prepared(ids, latents).float()

    return step


@run
def kohya_network(args):
    """prepare(unet, text_encoder, network, optimizer, dataloader) with an optimizer of the network's parameters
    only, the UNet and text encoder frozen after prepare(), and the network saved with safetensors' save_file as
    its state_dict() gives it (no save precision)."""
    out, precision = args.out, args.precision
    old, version = old_safetensors_torch(args.old_safetensors)
    acc = accelerator(zero_stage=args.stage, mixed_precision=None if precision == "no" else precision)
    torch.manual_seed(0)
    unet, text_encoder = TinyUNet(), TinyTextEncoder()
    network = tiny_lora_network(unet, text_encoder)
    network.apply_to()
    optimizer = torch.optim.AdamW(network.prepare_optimizer_params(1e-2, 2e-2))
    if args.reference:  # the hand-written merge: one module, run whole
        merged, optimizer, loader = acc.prepare(
            Together(tinyunet=unet, tinytextencoder=text_encoder, loranetwork=network), optimizer, data())
        models = merged.module.models
        unet, text_encoder, network = models["tinyunet"], models["tinytextencoder"], models["loranetwork"]
        step, accumulated = step_function(merged, precision), (merged,)
    else:
        unet, text_encoder, network, optimizer, loader = acc.prepare(unet, text_encoder, network, optimizer, data())
        step = step_function(lambda ids, latents: unet(latents, text_encoder(ids)), precision)
        accumulated = (network,)
    unet.requires_grad_(False)  # train_network.py freezes the models only after prepare()
    text_encoder.requires_grad_(False)
    losses = train(acc, step, optimizer, loader, accumulated)

    result = {"losses": losses, "safetensors": version}
    state = network.state_dict()
    result.update(tensors=len(state), storages=storages(state))
    if args.reference:  # without the fix, as kohya saves it; then the truth, copied without the fix
        result["save_error"] = save_error(network.save_weights, str(out / "network.safetensors"), old.save_file)
        torch.save(full_state(network), out / "network.truth.pt")
        return result
    network.save_weights(str(out / "network.safetensors"), old.save_file)
    result["loads_back_equal"] = all_equal(state, old.load_file(str(out / "network.safetensors")))
    for name, model in (("tinyunet", unet), ("tinytextencoder", text_encoder)):  # the frozen models save too
        model_state = model.state_dict()
        old.save_file(model_state, str(out / f"{name}.safetensors"))
        result[f"{name}_loads_back_equal"] = all_equal(model_state, old.load_file(str(out / f"{name}.safetensors")))
    # A parameter DeepSpeed's optimizer holds, frozen after prepare(): that one is worth a warning.
    acc.unwrap_model(network).lora_unet_out.lora_up.weight.requires_grad_(False)
    acc.save_state(str(out / "state"))
    return result


def tied_text_encoder():
    """TinyTextEncoder with an output layer tied to its embedding, as language models tie theirs."""
    text_encoder = TinyTextEncoder()
    text_encoder.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
    text_encoder.head.weight = text_encoder.embed.weight
    return text_encoder


def saved_both_ways(old, model, state, out, name):
    """What old safetensors' save_file and save_model, and torch.save, make of one model's state dict."""
    result = {"save_file_error": save_error(old.save_file, state, str(out / f"{name}.safetensors"))}
    if result["save_file_error"] is None:
        result["save_file_equal"] = all_equal(state, old.load_file(str(out / f"{name}.safetensors")))
    old.save_model(model, str(out / f"{name}.model.safetensors"))  # drops the second name of a tied weight
    saved = old.load_file(str(out / f"{name}.model.safetensors"))
    result["save_model_equal"] = all(torch.equal(state[k].cpu(), v) for k, v in saved.items())
    result["save_model_keys"] = len(saved)
    torch.save(state, out / f"{name}.pt")
    with zipfile.ZipFile(out / f"{name}.pt") as archive:  # the tensor data torch.save wrote, storage by storage
        result["torch_save_data_bytes"] = sum(i.file_size for i in archive.infolist() if "/data/" in i.filename
                                              and i.filename.rsplit("/", 1)[1].isdigit())
    loaded = torch.load(out / f"{name}.pt", weights_only=True)
    result["torch_save_storages"] = storages(loaded)
    result["torch_save_equal"] = all_equal(state, loaded)
    return result


@run
def tied_weights(args):
    """Full training of two merged models, one with a tied weight; then each model's state dict saved, beside
    the same untrained models saved without DeepSpeed (what plain accelerate gives)."""
    out = args.out
    old, version = old_safetensors_torch(args.old_safetensors)
    acc = accelerator(zero_stage=args.stage)
    torch.manual_seed(0)
    unet, text_encoder = TinyUNet(), tied_text_encoder()
    (out / "plain").mkdir()
    plain = {name: saved_both_ways(old, model, model.state_dict(), out / "plain", name)
             for name, model in (("tinyunet", unet), ("tinytextencoder", text_encoder))}
    optimizer = torch.optim.AdamW([*unet.parameters(), *text_encoder.parameters()], lr=1e-2)
    unet, text_encoder, optimizer, loader = acc.prepare(unet, text_encoder, optimizer, data())
    losses = train(acc, lambda ids, latents: unet(latents, text_encoder(ids)), optimizer, loader, (unet, text_encoder))
    merged = {}
    for name, model in (("tinyunet", unet), ("tinytextencoder", text_encoder)):
        state = model.state_dict()
        merged[name] = saved_both_ways(old, acc.unwrap_model(model), state, out, name)
        merged[name]["storages"], merged[name]["tensors"] = storages(state), len(state)
    return {"losses": losses, "safetensors": version, "plain": plain, "merged": merged}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("run", choices=RUNS)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--precision", default="no", choices=["no", "bf16"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--old-safetensors", required=True, help="a folder holding safetensors 0.3.x alone")
    p.add_argument("--reference", action="store_true")
    return p.parse_args()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="LOG %(name)s %(levelname)s %(message)s")
    logging.getLogger("accel_ds_fix").setLevel(logging.DEBUG)
    arguments = parse_args()
    arguments.out.mkdir(parents=True, exist_ok=True)
    (arguments.out / "result.json").write_text(json.dumps(RUNS[arguments.run](arguments)))
