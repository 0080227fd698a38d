"""One training of two models and one optimizer, with DeepSpeed or without (tests/test_deepspeed_on_off.py): the
pattern of diffusers' train_dreambooth.py --train_text_encoder (AdamW over both models, a decaying learning rate,
clip_grad_norm_ every step, noise drawn from the global random state, a custom object registered for
checkpointing), in fp32 on the CPU, real accelerate + DeepSpeed.

    python tests/on_off_runs.py --layout none|zero1|zero2|zero3|zero2-offload|zero3-offload --steps N
        [--first-step K --resume DIR] [--save DIR --save-at K (K = the first step: before any step)] [--sgd] [--precision fp32|bf16] [--width W]
        [--clip MAX_NORM (1.0; 0: no clipping on either side)] --out FILE.json

--precision bf16: accelerate's mixed_precision="bf16" on both sides (DeepSpeed's bf16 with fp32 master weights;
plain accelerate's fp32 weights under bf16 autocast). --width: the models' width (16; 1536 makes a checkpoint whose
conversion takes seconds, for a kill in the middle of it; the learning rate is scaled by 16/width, as an Adam step moves
each output by about width x lr). Under a launcher of several processes (WORLD_SIZE set)
every process trains on the same batches and steps the scheduler once a step, so that two processes train as one;
--step-noise draws the noise from a generator of the step instead of the global random state (a checkpoint of one
process holds no random_states_1.pkl: accelerate leaves process 1's as it was). The main process writes --out and
--weights.

Writes to --out: the losses, the learning rate of each step, the custom object's count, and (with --weights) each
model's final weights (torch.save).
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, set_seed  # noqa: E402
import train_two_models  # noqa: E402
from train_two_models import LATENT, TOKENS, VOCAB, TinyTextEncoder, TinyUNet, single_process_env  # noqa: E402

import accel_ds_fix  # noqa: E402,F401

LAYOUTS = {
    "zero1": dict(zero_stage=1), "zero2": dict(zero_stage=2), "zero3": dict(zero_stage=3),
    "zero2-offload": dict(zero_stage=2, offload_optimizer_device="cpu"),
    "zero3-offload": dict(zero_stage=3, offload_optimizer_device="cpu", offload_param_device="cpu"),
}


class StepCount:
    """A custom object registered for checkpointing (accelerate's custom_checkpoint_0.pkl)."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def batch(step, size=2):
    g = torch.Generator().manual_seed(1000 + step)  # the data of a step, whichever run reaches it
    return torch.randint(0, VOCAB, (size, TOKENS), generator=g), torch.randn(size, LATENT, generator=g)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layout", default="none")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--first-step", type=int, default=0)
    p.add_argument("--resume")
    p.add_argument("--save")
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--sgd", action="store_true")
    p.add_argument("--weights")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--width", type=int, default=train_two_models.WIDTH)
    p.add_argument("--step-noise", action="store_true")
    p.add_argument("--clip", type=float, default=1.0, help="the max norm of both sides' clipping; 0: none")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    precision = "no" if args.precision == "fp32" else args.precision
    # several processes: the scheduler steps once a step, as with one (accelerate steps it once per process otherwise)
    once = dict(step_scheduler_with_optimizer=int(os.environ.get("WORLD_SIZE", "1")) == 1)
    if args.layout == "none":
        accelerator = Accelerator(mixed_precision=precision, **once)
    else:
        if "RANK" in os.environ:  # under a launcher: the process group first, so that accelerate sees its size
            from accelerate import PartialState

            PartialState(backend="gloo")
        single_process_env()  # nothing under a launcher
        plugin = DeepSpeedPlugin(gradient_clipping=args.clip, **LAYOUTS[args.layout])
        accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision=precision, **once)
    train_two_models.WIDTH = args.width  # read by the models' __init__
    set_seed(0)
    unet, text_encoder = TinyUNet(), TinyTextEncoder()
    params = [*unet.parameters(), *text_encoder.parameters()]
    lr = 1e-2 * min(1.0, 16 / args.width)
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9) if args.sgd else torch.optim.AdamW(params, lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.3 * step))
    dataset = torch.utils.data.TensorDataset(torch.zeros(8, LATENT))  # accelerate's DeepSpeed config wants one
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=2)
    unet, text_encoder, optimizer, dataloader, scheduler = accelerator.prepare(
        unet, text_encoder, optimizer, dataloader, scheduler)
    counter = StepCount()
    accelerator.register_for_checkpointing(counter)
    if args.resume:
        accelerator.load_state(args.resume)

    if args.save and args.save_at == args.first_step:  # saved as loaded (a conversion's round trip), or at the start
        accelerator.save_state(args.save)
    losses, lrs = [], []
    for step in range(args.first_step, args.first_step + args.steps):
        ids, latents = batch(step)
        if args.step_noise:  # the same on every process, whichever random states a load restored
            noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(2000 + step))
        else:  # the global random state: restored by load_state, or the losses differ
            noise = torch.randn_like(latents)
        with accelerator.accumulate(unet, text_encoder):
            pred = unet(latents + noise, text_encoder(ids))
            loss = torch.nn.functional.mse_loss(pred, noise)
            accelerator.backward(loss)
            if accelerator.sync_gradients and args.clip:
                accelerator.clip_grad_norm_(params, args.clip)
            lrs.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        counter.count += 1
        losses.append(loss.item())
        if args.save and step + 1 == args.save_at:
            accelerator.save_state(args.save)
    if args.weights:  # every process gathers (ZeRO-3), the main one writes
        weights = {name: {k: v.detach().float().clone() for k, v in accelerator.unwrap_model(m).state_dict().items()}
                   for name, m in (("unet", unet), ("text_encoder", text_encoder))}
        if accelerator.is_main_process:
            torch.save(weights, args.weights)
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "lrs": lrs, "count": counter.count,
                       "processes": accelerator.num_processes}, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
