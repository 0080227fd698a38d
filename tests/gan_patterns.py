"""Training loops of GAN-style scripts (two models, two optimizers, two schedulers in one prepare()), replayed in
our own words on tiny convolutional models, under plain accelerate or accelerate + DeepSpeed on the CPU:

    python tests/gan_patterns.py PATTERN --deepspeed --zero-stage 2 --accumulation 2 --precision bf16 --out R.json
    python tests/gan_patterns.py PATTERN --out R.json                          # the same loop without DeepSpeed

PATTERN:
  vqgan   diffusers' examples/vqgan/train_vqgan.py: generator and discriminator phases alternate every
          `accumulation` batches; each phase starts with its own optimizer's zero_grad(set_to_none=True); the
          generator loss goes through the discriminator while the discriminator still requires grad, inside
          `accelerator.accumulate(model)`, and weighs it by torch.autograd.grad norms of the generator's last
          layer; the discriminator loss adds a gradient penalty (create_graph=True); the save hook writes both
          models into subfolders and pops two weights entries, the load hook pops both models and loads them.
  titok   bytedance's TiTok trainers: the discriminator lives inside a loss module (with a frozen perceptual
          network) that has its own optimizer; the generator phase turns the discriminator's requires_grad off,
          the discriminator phase on; both phases run on every batch, each ending with its optimizer's zero_grad().
  joint   one loss through both models outside accelerate.accumulate (refused: which engine does it train?).
  refusals  the prepare() calls one engine per optimizer cannot train, each tried in this process; --out gets
          {case: the MergeError's text} (lucidrains-style optimizers sharing a module's parameters, a model split
          across optimizers, SANA-Sprint-style frozen backbone inside both models, ZeRO-3, fp16).
--skip-discr-zero-grad leaves the vqgan loop's discriminator zero_grad() out (refused under DeepSpeed).
Under `accelerate launch --num_processes 2` every process trains on the same batches.
--save-at N saves after N batches into --checkpoint; --resume DIR loads it first and trains --steps more batches;
--save-model DIR exports the second model with accelerator.save_model at the end; --frozen-perceptual passes a
frozen perceptual network to prepare() as a third model (vqgan's timm network, prepared) for the generator loss.
Prints nothing of interest; results (losses per phase, each engine's step count, final weights) go to --out.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, set_seed  # noqa: E402
from train_two_models import single_process_env  # noqa: E402

import accel_ds_fix  # noqa: E402,F401

SIZE = 8


class Generator(torch.nn.Module):
    """An autoencoder returning (reconstruction, commit loss), as diffusers' VQModel does with return_dict=False."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.decoder = torch.nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x):
        h = torch.tanh(self.encoder(x))
        return self.decoder(h), 0.1 * h.pow(2).mean()


class Discriminator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # spectral norm, as diffusers' vqgan Discriminator: its fp32 buffers beside DeepSpeed's bf16 weights
        self.conv = torch.nn.utils.spectral_norm(torch.nn.Conv2d(3, 4, 3, padding=1))
        self.head = torch.nn.Linear(4 * SIZE * SIZE, 1)

    def forward(self, x):
        return self.head(F.leaky_relu(self.conv(x)).flatten(1))


class LossModule(torch.nn.Module):
    """TiTok's ReconstructionLoss_Stage2 in short: a frozen perceptual network and the trained discriminator."""

    def __init__(self):
        super().__init__()
        self.perceptual = torch.nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)
        self.discriminator = Discriminator()

    def forward(self, images, reconstructions, mode):
        if mode == "generator":
            self.discriminator.requires_grad_(False)
            perceptual = F.mse_loss(self.perceptual(images), self.perceptual(reconstructions))
            return F.mse_loss(images, reconstructions) + perceptual - 0.1 * self.discriminator(reconstructions).mean()
        self.discriminator.requires_grad_(True)
        real = self.discriminator(images.detach())
        fake = self.discriminator(reconstructions.detach())
        return (F.relu(1 - real) + F.relu(1 + fake)).mean()


class Backboned(torch.nn.Module):
    """A model around a (frozen) backbone it may share with another model, SANA-Sprint style."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Conv2d(4, 3, 1)

    def forward(self, x):
        return self.head(self.backbone(x))


def refusals(args):
    """Each prepare() that one engine per optimizer refuses, with the text it says."""
    from accel_ds_fix.errors import MergeError

    def deepspeed_accelerator(stage=2, fp16=False):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)  # one Accelerator per case, each with its own config
        GradientState._reset_state()
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                  "fp16": {"enabled": fp16}}
        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))

    def shared_module():
        model = Generator()  # lucidrains' trainers: two optimizers over one module's parameters
        return (model, torch.optim.AdamW(model.parameters()), torch.optim.Adam(model.parameters()))

    def split_model():
        model = Generator()
        return (model, torch.optim.AdamW(model.encoder.parameters()), torch.optim.AdamW(model.decoder.parameters()))

    def shared_backbone():
        backbone = torch.nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)
        generator, discriminator = Backboned(backbone), Backboned(backbone)
        return (generator, discriminator, torch.optim.AdamW(generator.head.parameters()),
                torch.optim.AdamW(discriminator.head.parameters()))

    def two_models():
        generator, discriminator = Generator(), Discriminator()
        return (generator, discriminator, torch.optim.AdamW(generator.parameters()),
                torch.optim.AdamW(discriminator.parameters()))

    cases = {
        "shared_module": (deepspeed_accelerator, shared_module),
        "split_model": (deepspeed_accelerator, split_model),
        "shared_backbone": (deepspeed_accelerator, shared_backbone),
        "zero3": (lambda: deepspeed_accelerator(stage=3), two_models),
        "fp16": (lambda: deepspeed_accelerator(fp16=True), two_models),
    }
    said = {}
    for name, (make_accelerator, make_args) in cases.items():
        acc = make_accelerator()
        try:
            acc.prepare(*make_args())
            said[name] = None
        except MergeError as exc:
            said[name] = str(exc)
        said[name + "_engines_built"] = len(acc._models)
    Path(args.out).write_text(json.dumps(said))


def grad_layer_wrt_loss(loss, layer):
    return torch.autograd.grad(outputs=loss, inputs=layer, grad_outputs=torch.ones_like(loss), retain_graph=True)[0]


def gradient_penalty(images, output, weight=10):
    gradients = torch.autograd.grad(outputs=output, inputs=images, grad_outputs=torch.ones(output.size()),
                                    create_graph=True, retain_graph=True, only_inputs=True)[0]
    gradients = gradients.reshape(gradients.shape[0], -1)
    return weight * ((gradients.norm(2, dim=1) - 1) ** 2).mean()


def images(batches, batch=2):
    return torch.randn(batches, batch, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1)).clamp(-1, 1)


def vqgan_step(acc, i, pixel_values, model, discriminator, opts, scheds, accumulation, out):
    optimizer, discr_optimizer = opts
    generator_step = ((i // accumulation) % 2) == 0
    if generator_step:
        optimizer.zero_grad(set_to_none=True)
    elif not out["skip_discr_zero_grad"]:
        discr_optimizer.zero_grad(set_to_none=True)
    fmap, commit_loss = model(pixel_values)
    if generator_step:
        with acc.accumulate(model):
            loss = F.mse_loss(pixel_values, fmap.float())
            if out["perceptual"] is not None:  # a frozen network passed to prepare() too (joins the first engine)
                perceptual = F.mse_loss(out["perceptual"](pixel_values).float(), out["perceptual"](fmap).float())
            else:
                perceptual = F.l1_loss(pixel_values.mean(1), fmap.float().mean(1))
            gen_loss = -discriminator(fmap).float().mean()
            last_layer = acc.unwrap_model(model).decoder.weight
            norm_perceptual = grad_layer_wrt_loss(perceptual, last_layer).norm(p=2)
            norm_gen = grad_layer_wrt_loss(gen_loss, last_layer).norm(p=2)
            adaptive_weight = (norm_perceptual / norm_gen.clamp(min=1e-8)).clamp(max=1e4)
            loss = loss + commit_loss.float() + perceptual + adaptive_weight * gen_loss
            acc.backward(loss)
            if acc.sync_gradients:  # the norm each optimizer's parameters had (max_norm too large to clip)
                out["generator_grad_norm"].append(float(acc.clip_grad_norm_(model.parameters(), 1e9)))
            optimizer.step()
            scheds[0].step()
            out["generator"].append(loss.item())
    else:
        with acc.accumulate(discriminator):
            fmap.detach_()
            pixel_values.requires_grad_()
            real = discriminator(pixel_values)
            fake = discriminator(fmap)
            loss = (F.relu(1 + fake) + F.relu(1 - real)).float().mean()
            loss = loss + gradient_penalty(pixel_values, real)
            acc.backward(loss)
            if acc.sync_gradients:
                out["discriminator_grad_norm"].append(float(acc.clip_grad_norm_(discriminator.parameters(), 1e9)))
            discr_optimizer.step()
            scheds[1].step()
            out["discriminator"].append(loss.item())


def backward_and_step(acc, loss, optimizer, scheduler, losses):
    acc.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item())


def titok_step(acc, i, images_, model, loss_module, opts, scheds, accumulation, out):
    # accumulate() given a list in one phase and several models in the other: both call forms are routed
    with acc.accumulate([model, loss_module]):
        reconstructions, _ = model(images_)
        loss = loss_module(images_, reconstructions, mode="generator").float()
        backward_and_step(acc, loss, opts[0], scheds[0], out["generator"])
    with acc.accumulate(model, loss_module):
        loss = loss_module(images_, reconstructions, mode="discriminator").float()
        backward_and_step(acc, loss, opts[1], scheds[1], out["discriminator"])


def joint_step(acc, i, images_, model, discriminator, opts, scheds, accumulation, out):
    reconstructions, _ = model(images_)
    loss = F.mse_loss(images_, reconstructions) - discriminator(reconstructions).mean()
    acc.backward(loss)


def save_hook_for(acc, calls):
    def save_model_hook(models, weights, output_dir):
        calls.append({"classes": [m.__class__.__name__ for m in models], "weights": len(weights)})
        if acc.is_main_process:
            for name, model in zip(("generator", "discriminator"), models):
                os.makedirs(os.path.join(output_dir, name), exist_ok=True)
                torch.save(acc.unwrap_model(model).state_dict(), os.path.join(output_dir, name, "weights.pt"))
            weights.pop()
            weights.pop()

    return save_model_hook


def load_hook_for(calls):
    def load_model_hook(models, input_dir):
        calls.append([m.__class__.__name__ for m in models])
        discriminator = models.pop()
        discriminator.load_state_dict(torch.load(os.path.join(input_dir, "discriminator", "weights.pt")))
        model = models.pop()
        model.load_state_dict(torch.load(os.path.join(input_dir, "generator", "weights.pt")))

    return load_model_hook


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("pattern", choices=["vqgan", "titok", "joint", "refusals"])
    parser.add_argument("--skip-discr-zero-grad", action="store_true")
    parser.add_argument("--constant-lr", action="store_true")
    parser.add_argument("--frozen-perceptual", action="store_true")
    parser.add_argument("--save-model", help="accelerator.save_model(discriminator) into this folder at the end")
    parser.add_argument("--deepspeed", action="store_true")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--offload", default="none")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--precision", default="no")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--checkpoint")
    parser.add_argument("--resume")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    single_process_env()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # `accelerate launch --num_processes 2` on the CPU
        from accelerate import PartialState

        PartialState(backend="gloo")
    if args.pattern == "refusals":
        return refusals(args)
    kwargs = {"gradient_accumulation_steps": args.accumulation, "mixed_precision": args.precision}
    if args.deepspeed:
        config = {
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": args.accumulation,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": args.zero_stage, "offload_optimizer": {"device": args.offload}},
            "bf16": {"enabled": args.precision == "bf16"}, "fp16": {"enabled": args.precision == "fp16"},
        }
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=config)
    acc = Accelerator(**kwargs)
    set_seed(0)
    model = Generator()
    second = LossModule() if args.pattern == "titok" else Discriminator()
    trained_second = second.discriminator if args.pattern == "titok" else second
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    discr_optimizer = torch.optim.AdamW(trained_second.parameters(), lr=2e-2)
    # accelerate steps a scheduler once per process at each sync step: --constant-lr compares process counts
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if args.constant_lr else 1 / (1 + s))
    discr_lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        discr_optimizer, lambda s: 1.0 if args.constant_lr else 1 / (1 + 2 * s))
    hooks = {"save": [], "load": []}
    acc.register_save_state_pre_hook(save_hook_for(acc, hooks["save"]))
    acc.register_load_state_pre_hook(load_hook_for(hooks["load"]))
    perceptual = None
    if args.frozen_perceptual:
        perceptual = torch.nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)
        model, second, perceptual, optimizer, discr_optimizer, lr_scheduler, discr_lr_scheduler = acc.prepare(
            model, second, perceptual, optimizer, discr_optimizer, lr_scheduler, discr_lr_scheduler
        )
    else:
        model, second, optimizer, discr_optimizer, lr_scheduler, discr_lr_scheduler = acc.prepare(
            model, second, optimizer, discr_optimizer, lr_scheduler, discr_lr_scheduler
        )
    step = {"vqgan": vqgan_step, "titok": titok_step, "joint": joint_step}[args.pattern]
    data = images(32)
    start = 0
    if args.resume:
        acc.load_state(args.resume)
        start = json.loads(Path(args.resume + ".batch.json").read_text())["batch"]
    out = {"generator": [], "discriminator": [], "hooks": hooks, "skip_discr_zero_grad": args.skip_discr_zero_grad,
           "generator_grad_norm": [], "discriminator_grad_norm": [], "perceptual": perceptual}
    model.train()
    second.train()
    for i in range(start, start + args.steps):
        step(acc, i, data[i].clone(), model, second, (optimizer, discr_optimizer),
             (lr_scheduler, discr_lr_scheduler), args.accumulation, out)
        if args.save_at == i + 1:
            acc.save_state(args.checkpoint)
            if acc.is_main_process:
                Path(args.checkpoint + ".batch.json").write_text(json.dumps({"batch": i + 1}))  # beside it
    out["lr"] = [lr_scheduler.get_last_lr()[0], discr_lr_scheduler.get_last_lr()[0]]
    if args.deepspeed:
        out["engine_steps"] = [m.global_steps for m in acc._models]
    out["weights"] = {
        name: {k: v.float().tolist() for k, v in acc.get_state_dict(m).items()}
        for name, m in (("generator", model), ("second", second))
    }
    del out["perceptual"]
    if args.save_model:  # accelerate's save_model: one model's own weights, as without DeepSpeed
        acc.save_model(second, args.save_model)
    if acc.is_main_process:
        Path(args.out).write_text(json.dumps(out))
    acc.end_training()


if __name__ == "__main__":
    main()
