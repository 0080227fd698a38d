"""A miniature of kohya's train_db.py / diffusers' train_dreambooth.py --train_text_encoder.

Two models (a "text encoder" and a "unet"), one optimizer, one prepare() call, under accelerate + DeepSpeed,
on the CPU. Without accel_ds_fix this script fails inside accelerator.prepare(); with it, it trains.

    python examples/train_two_models.py --zero-stage 2 --offload cpu                 # fix not active: fails
    ACCEL_DS_FIX=1 python examples/train_two_models.py --zero-stage 2 --offload cpu  # trains

--reference trains the same models the way one fixes this by hand (one hand-written merged module), so that
the tests can check the fix gives the same losses. Results go to --out as JSON.
"""

import argparse
import inspect
import json
import logging
import os
import socket
import sys

if "--import-fix-first" in sys.argv:  # activation before accelerate is imported
    import accel_ds_fix  # noqa: F401

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, set_seed

if "--import-fix" in sys.argv:  # activation after accelerate is imported
    import accel_ds_fix  # noqa: F401

VOCAB, TOKENS, WIDTH, LATENT = 32, 6, 16, 8


class TinyTextEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, input_ids):
        return self.norm(torch.tanh(self.proj(self.embed(input_ids))))


class TinyUNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(LATENT, WIDTH)
        self.cond = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, LATENT)

    def forward(self, noisy_latents, encoder_hidden_states):
        h = self.inp(noisy_latents) + self.cond(encoder_hidden_states.mean(dim=1))
        return self.out(torch.nn.functional.silu(h))


class HandMerged(torch.nn.Module):
    """The by-hand workaround: both models inside one module, one forward for a whole step."""

    def __init__(self, text_encoder, unet):
        super().__init__()
        # Same order as the prepare(unet, text_encoder, ...) call, so DeepSpeed sees the parameters in one order.
        self.models = torch.nn.ModuleDict({"tinyunet": unet, "tinytextencoder": text_encoder})

    def forward(self, input_ids, noisy_latents):
        dtype = next(self.parameters()).dtype
        autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
        with autocast:
            return self.models["tinyunet"](noisy_latents, self.models["tinytextencoder"](input_ids))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--offload", default="none", choices=["none", "cpu", "nvme"], help="ZeRO optimizer offload device")
    p.add_argument("--nvme-path", help="with --offload nvme: the folder DeepSpeed swaps the optimizer states into")
    p.add_argument("--offload-params", action="store_true", help="ZeRO-3: the weights on the CPU too (zero3-offload)")
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--steps", type=int, default=6, help="batches to train on")
    p.add_argument("--first-step", type=int, default=0, help="batch to start from (after --resume)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--width", type=int, default=WIDTH, help="the models' hidden width (512: sub groups large "
                                                            "enough that NVMe offload swaps them)")
    p.add_argument("--gradient-clipping", default="1.0",
                   help="the DeepSpeed config's gradient_clipping: a norm, 0 for none, or auto (accelerate fills it in)")
    p.add_argument("--freeze-text-encoder", action="store_true", help="train the unet only (text encoder frozen)")
    p.add_argument("--reference", action="store_true", help="train through a hand-written merged module")
    p.add_argument("--save-state", help="accelerator.save_state() here after the last step")
    p.add_argument("--save-state-at", type=int, default=0, help="with --save-state: save after this many steps instead")
    p.add_argument("--resume", help="accelerator.load_state() from here before training")
    p.add_argument("--losses-before-save", help="write the losses as JSON here before the final save_state")
    p.add_argument("--export", help="save each model here with get_state_dict/save_model/unwrap_model")
    p.add_argument("--out", help="write losses and results as JSON here")
    p.add_argument("--import-fix", action="store_true", help="import accel_ds_fix after accelerate")
    p.add_argument("--import-fix-first", action="store_true", help="import accel_ds_fix before accelerate")
    return p.parse_args()


def single_process_env():
    # deepspeed.initialize wants a process group even for one process; launchers set these, `python` does not.
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def init_process_group():
    # The CPU has no NCCL, which accelerate before 0.30 asks for under DeepSpeed; a process group that
    # already exists is taken as it is, by every accelerate version.
    import deepspeed

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def accumulate(accelerator, models):
    # accelerate < 0.19 accumulates one model (scripts of that time pass the unet); later ones take several.
    if inspect.signature(accelerator.accumulate).parameters.get("models"):
        return accelerator.accumulate(*models)
    return accelerator.accumulate(models[0])


def make_accelerator(args):
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":  # `accelerate launch` with a DeepSpeed config
        try:
            from accelerate import PartialState  # accelerate >= 0.17; it must see the launcher's world size
        except ImportError:
            init_process_group()
        else:
            PartialState(backend="nccl" if torch.cuda.is_available() else "gloo")
        # As train_db.py and train_dreambooth.py do: the script chooses its precision, the config the rest.
        return Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.gas)
    init_process_group()
    plugin = DeepSpeedPlugin(
        zero_stage=args.zero_stage,
        offload_optimizer_device=args.offload,
        offload_optimizer_nvme_path=args.nvme_path,
        offload_param_device="cpu" if args.offload_params else "none",
        gradient_accumulation_steps=args.gas,
        gradient_clipping=None if args.gradient_clipping == "auto" else float(args.gradient_clipping),
        zero3_save_16bit_model=True,  # lets --reference export its merged module under ZeRO-3
    )
    return Accelerator(deepspeed_plugin=plugin, mixed_precision=args.mixed_precision)


def make_data(args, process_index, num_processes):
    # Fixed-size draws, then a slice: a run of 3 steps sees the same first batches as a run of 6.
    g = torch.Generator().manual_seed(1234)
    total = (args.first_step + args.steps) * args.batch_size * num_processes
    size = max(total, 256)
    ids = torch.randint(0, VOCAB, (size, TOKENS), generator=g)[:total]
    latents = torch.randn(size, LATENT, generator=g)[:total]
    noise = torch.randn(size, LATENT, generator=g)[:total]
    dataset = torch.utils.data.TensorDataset(ids, latents, noise)
    return torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=False)


def main():
    args = parse_args()
    global WIDTH
    WIDTH = args.width  # read by the models' constructors
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("accel_ds_fix").setLevel(logging.INFO)
    single_process_env()
    accelerator = make_accelerator(args)
    set_seed(0)
    text_encoder, unet = TinyTextEncoder(), TinyUNet()
    if args.freeze_text_encoder:
        text_encoder.requires_grad_(False)
    trained = list(unet.parameters()) + ([] if args.freeze_text_encoder else list(text_encoder.parameters()))
    optimizer = torch.optim.AdamW(trained, lr=args.lr)
    dataloader = make_data(args, accelerator.process_index, accelerator.num_processes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))

    if args.reference:
        merged, optimizer, dataloader, scheduler = accelerator.prepare(
            HandMerged(text_encoder, unet), optimizer, dataloader, scheduler
        )
        step_models = (merged,)
        forward = merged
    else:
        # The line every two-model training script has, and the one DeepSpeed used to fail on.
        unet, text_encoder, optimizer, dataloader, scheduler = accelerator.prepare(
            unet, text_encoder, optimizer, dataloader, scheduler
        )
        step_models = (unet, text_encoder)

        def forward(input_ids, noisy_latents):
            return unet(noisy_latents, text_encoder(input_ids))

    if args.resume:
        accelerator.load_state(args.resume)

    losses = []
    for step, (ids, latents, noise) in enumerate(dataloader):
        if step < args.first_step:
            continue
        with accumulate(accelerator, step_models):
            pred = forward(ids, latents + noise)
            loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach().float()).mean().item())
        accelerator.print(f"step {step}: loss {losses[-1]:.6f}")
        if args.save_state and len(losses) == args.save_state_at:
            accelerator.save_state(args.save_state)

    result = {"losses": losses, "fix_active": "accel_ds_fix" in sys.modules}
    if args.losses_before_save and accelerator.is_main_process:  # for a save that may not finish
        with open(args.losses_before_save, "w") as f:
            json.dump({"losses": losses}, f)
    if args.save_state and not args.save_state_at:
        accelerator.save_state(args.save_state)
    if args.export:
        exported = {"merged": merged} if args.reference else {"tinyunet": unet, "tinytextencoder": text_encoder}
        result["exported"] = export(accelerator, exported, args.export)
    accelerator.wait_for_everyone()
    if args.out and accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(result, f)
    accelerator.end_training()


def export(accelerator, models, directory):
    """Save every model the ways training scripts do; return where each file went."""
    written = {}
    for name, model in models.items():
        state = accelerator.get_state_dict(model)
        unwrapped = accelerator.unwrap_model(model)
        unwrapped_state = unwrapped.state_dict()  # every process: a ZeRO-3 gather is collective
        os.makedirs(directory, exist_ok=True)
        if accelerator.is_main_process:
            torch.save(state, os.path.join(directory, f"{name}.get_state_dict.pt"))
            torch.save(unwrapped_state, os.path.join(directory, f"{name}.unwrap_model.pt"))
        else:  # what the other processes hold, so that several-process runs can check it too
            rank = accelerator.process_index
            torch.save(unwrapped_state, os.path.join(directory, f"{name}.unwrap_model.rank{rank}.pt"))
        accelerator.save_model(model, os.path.join(directory, f"{name}.save_model"), safe_serialization=False)
        written[name] = type(unwrapped).__name__
    return written


if __name__ == "__main__":
    main()
