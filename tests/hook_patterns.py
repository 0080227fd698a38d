"""The save/load hook patterns of real training scripts, replayed in our own words on the tiny models of
examples/train_two_models.py, under real accelerate + DeepSpeed on the CPU. One run per process:

    python tests/hook_patterns.py PATTERN --zero-stage 2 --steps 6 --save-at 3 --checkpoint DIR --out R.json
    python tests/hook_patterns.py PATTERN --zero-stage 2 --steps 3 --resume DIR --out R2.json

PATTERN:
  diffusers   train_dreambooth.py --train_text_encoder, with a (tiny) transformers CLIPTextModel: the save hook
              picks each model by class, save_pretrained()s it into a subfolder and pops one weights entry per
              model; the load hook pops every model, builds the text encoder saved in its subfolder with
              CLIPTextModel.from_pretrained (under ZeRO-3 transformers would build it partitioned) and
              load_state_dict()s it into the popped model.
  lora        train_dreambooth_lora.py --train_text_encoder (peft): frozen base models with LoRA adapters;
              the save hook writes get_peft_model_state_dict() of each model, the load hook pops the models and
              loads with set_peft_model_state_dict(). --models 3 adds a second text encoder (SDXL scripts).
  kohya       kohya's train_network.py: unet and text encoder frozen, a trained "network"; the save hook pops
              the weights of every model but the network by index and writes train_state.json, the load hook
              pops those models by index and reads train_state.json.
--unfreeze-after-prepare turns the text encoder's embedding trainable after prepare() (several SDXL/SD3 LoRA
scripts do), after load_state when resuming.
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
from train_two_models import LATENT, TOKENS, VOCAB, WIDTH, TinyTextEncoder, TinyUNet, single_process_env  # noqa: E402

import accel_ds_fix  # noqa: E402,F401

ACCELERATE_MODEL_FILES = ("model.safetensors", "pytorch_model.bin", "model_1.safetensors", "pytorch_model_1.bin")


class TinyTextEncoder2(torch.nn.Module):
    """A second text encoder of another class (SDXL's CLIPTextModelWithProjection beside CLIPTextModel)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, input_ids):
        return torch.tanh(self.proj(self.embed(input_ids)))


class Network(torch.nn.Module):
    """kohya's LoRA network: a module of its own, the only one trained."""

    def __init__(self):
        super().__init__()
        self.down = torch.nn.Linear(WIDTH, 4, bias=False)
        self.up = torch.nn.Linear(4, WIDTH, bias=False)
        torch.nn.init.normal_(self.up.weight, std=0.1)

    def forward(self, hidden):
        return hidden + self.up(self.down(hidden))


def save_pretrained(model, folder):
    """diffusers' model.save_pretrained, in short: the model's own state dict into a folder."""
    os.makedirs(folder, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(folder, "weights.pt"))


class ClipTextEncoder(torch.nn.Module):
    """A tiny transformers CLIPTextModel, returning the hidden states TinyUNet conditions on."""

    @staticmethod
    def build():
        from transformers import CLIPTextConfig, CLIPTextModel

        return CLIPTextModel(CLIPTextConfig(hidden_size=WIDTH, intermediate_size=32, num_attention_heads=2,
                                            num_hidden_layers=2, max_position_embeddings=TOKENS, vocab_size=VOCAB))


def add_lora(model, targets):
    """diffusers' unet.add_adapter(LoraConfig(...)) / transformers' text_encoder.add_adapter(...)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=targets)
    model.peft_config = {"default": config}
    inject_adapter_in_model(config, model, "default")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("pattern", choices=["diffusers", "lora", "kohya"])
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--offload", default="none")
    p.add_argument("--models", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--checkpoint")
    p.add_argument("--save-on-main-only", action="store_true")  # diffusers' DreamBooth scripts up to v0.40
    p.add_argument("--export-on-main-only", action="store_true")  # every diffusers script's final export
    p.add_argument("--validate-on-main-only", action="store_true")  # diffusers' log_validation
    p.add_argument("--resume")
    p.add_argument("--unfreeze-after-prepare", action="store_true")
    p.add_argument("--embedding-in-optimizer", action="store_true")
    p.add_argument("--out", required=True)
    return p.parse_args()


def main():
    args = parse_args()
    single_process_env()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # `accelerate launch --num_processes 2` on the CPU
        from accelerate import PartialState

        PartialState(backend="gloo")
    plugin = DeepSpeedPlugin(zero_stage=args.zero_stage, offload_optimizer_device=args.offload,
                             zero3_save_16bit_model=True)
    if (args.export_on_main_only or args.validate_on_main_only) and args.zero_stage == 3:  # as at real size
        plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    accelerator = Accelerator(deepspeed_plugin=plugin)
    seen = {"save_hook": [], "load_hook": []}
    set_seed(0)
    unet = TinyUNet()
    text_encoder = ClipTextEncoder.build() if args.pattern == "diffusers" else TinyTextEncoder()
    text_encoder_2 = TinyTextEncoder2() if args.models == 3 else None
    network = None
    if args.pattern == "lora":
        for model in filter(None, (unet, text_encoder, text_encoder_2)):
            model.requires_grad_(False)
        add_lora(unet, ["inp", "cond", "out"])
        add_lora(text_encoder, ["proj"])
        if text_encoder_2 is not None:
            add_lora(text_encoder_2, ["proj"])
    elif args.pattern == "kohya":
        unet.requires_grad_(False)
        text_encoder.requires_grad_(False)
        network = Network()
    models = [m for m in (unet, text_encoder, text_encoder_2, network) if m is not None]
    trained = [p for m in models for p in m.parameters() if p.requires_grad]
    if args.embedding_in_optimizer:  # handed to the optimizer frozen, to be turned on after prepare()
        trained.append(text_encoder.embed.weight)
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    unwrap = accelerator.unwrap_model

    def save_model_hook(hook_models, weights, output_dir):
        seen["save_hook"].append({"classes": [m.__class__.__name__ for m in hook_models], "weights": len(weights)})
        if args.pattern == "kohya":  # pop the weights of every model but the network, by index
            remove = [i for i, m in enumerate(hook_models) if not isinstance(m, type(unwrap(network)))]
            for i in reversed(remove):
                if len(weights) > i:
                    weights.pop(i)
            seen["save_hook"][-1]["left"] = len(weights)
            with open(os.path.join(output_dir, "train_state.json"), "w") as f:
                json.dump({"current_step": len(losses)}, f)
            return
        if not accelerator.is_main_process:
            return
        for model in hook_models:
            if args.pattern == "diffusers":
                if isinstance(model, type(unwrap(unet))):
                    save_pretrained(model, os.path.join(output_dir, "unet"))
                else:
                    model.save_pretrained(os.path.join(output_dir, "text_encoder"))
            else:
                from peft import get_peft_model_state_dict

                name = model.__class__.__name__.lower()
                torch.save(get_peft_model_state_dict(model), os.path.join(output_dir, f"lora_{name}.pt"))
            weights.pop()

    def load_model_hook(hook_models, input_dir):
        seen["load_hook"].append([m.__class__.__name__ for m in hook_models])
        if args.pattern == "kohya":
            remove = [i for i, m in enumerate(hook_models) if not isinstance(m, type(unwrap(network)))]
            for i in reversed(remove):
                hook_models.pop(i)
            with open(os.path.join(input_dir, "train_state.json")) as f:
                seen["train_state"] = json.load(f)
            return
        while len(hook_models) > 0:
            model = hook_models.pop()
            if args.pattern == "diffusers":
                if isinstance(model, type(unwrap(unet))):
                    state = torch.load(os.path.join(input_dir, "unet", "weights.pt"), weights_only=True)
                else:
                    load_model = type(unwrap(text_encoder)).from_pretrained(input_dir, subfolder="text_encoder")
                    state = load_model.state_dict()
                model.load_state_dict(state)
            else:
                from peft import set_peft_model_state_dict

                name = model.__class__.__name__.lower()
                state = torch.load(os.path.join(input_dir, f"lora_{name}.pt"), weights_only=True)
                set_peft_model_state_dict(model, state, adapter_name="default")
            # What the hook wrote reached the model (ZeRO-3: the partitioned parameters), read back gathered.
            if args.pattern == "lora":
                from peft import get_peft_model_state_dict

                back = get_peft_model_state_dict(model)
            else:
                back = model.state_dict()
            seen.setdefault("hook_write_visible", []).append(all(torch.equal(back[k], v) for k, v in state.items()))

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    g = torch.Generator().manual_seed(1234)
    total = 12 * 2
    data = torch.utils.data.TensorDataset(
        torch.randint(0, VOCAB, (total, TOKENS), generator=g), torch.randn(total, LATENT, generator=g)
    )
    # its own generator: starting an epoch draws a base seed, which must not move the random states a resume restores
    loader = torch.utils.data.DataLoader(data, batch_size=2, generator=torch.Generator().manual_seed(0))
    prepared = accelerator.prepare(*models, optimizer, loader)
    models, optimizer, loader = prepared[: len(models)], prepared[-2], prepared[-1]
    unet, text_encoder = models[0], models[1]
    text_encoder_2 = models[2] if args.models == 3 and args.pattern == "lora" else None
    network = models[-1] if args.pattern == "kohya" else None
    first = 0
    if args.resume:
        accelerator.load_state(args.resume)
        first = 3
    if args.unfreeze_after_prepare:
        accelerator.unwrap_model(text_encoder).embed.requires_grad_(True)

    def forward(ids, latents):
        hidden = text_encoder(ids)
        if args.pattern == "diffusers":
            hidden = hidden[0]
        if text_encoder_2 is not None:
            hidden = hidden + text_encoder_2(ids)
        if network is not None:
            hidden = network(hidden)
        return unet(latents, hidden)

    losses = []
    for step, (ids, latents) in enumerate(loader):
        if step < first:
            continue
        if len(losses) == args.steps:
            break
        # diffusers' scripts draw noise each step: a resume equals the run only with the random states of its save
        target = latents + torch.randn_like(latents) if args.save_on_main_only else latents
        loss = torch.nn.functional.mse_loss(forward(ids, latents).float(), target)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if args.validate_on_main_only and len(losses) == 2:
            with torch.no_grad():
                forward(ids, latents)  # every process: passes
                seen["validated_together"] = True
                if accelerator.is_main_process:
                    forward(ids, latents)  # the main process alone
        saves_here = accelerator.is_main_process or not args.save_on_main_only
        if args.checkpoint and len(losses) == args.save_at and saves_here:
            accelerator.save_state(args.checkpoint)
            if not args.save_on_main_only:  # else written at the next step's first forward
                seen["accelerate_model_files"] = sorted(set(os.listdir(args.checkpoint)) & set(ACCELERATE_MODEL_FILES))
    seen["losses"] = losses
    if args.export_on_main_only:  # as the scripts end: a barrier, then the export on the main process alone
        from peft import get_peft_model_state_dict

        accelerator.wait_for_everyone()
        print("export on the main process alone begins", file=sys.stderr, flush=True)
        alone = get_peft_model_state_dict(unwrap(unet)) if accelerator.is_main_process else None
        frozen_alone = {k: tuple(v.shape) for k, v in unwrap(unet).state_dict().items()
                        if "lora_" not in k} if accelerator.is_main_process else None
        together = get_peft_model_state_dict(unwrap(unet))  # every process: ZeRO-3 gathers it
        if accelerator.is_main_process:
            seen["export_alone"] = {"keys": sorted(alone), "equal": all(torch.equal(alone[k], together[k])
                                                                           for k in together),
                                    "lora_B_nonzero": sum(bool(v.any()) for k, v in alone.items() if "lora_B" in k),
                                    "frozen_shapes": frozen_alone}
    if accelerator.is_main_process:
        Path(args.out).write_text(json.dumps(seen))
    # As diffusers' and kohya's scripts end. A gloo process group left to interpreter shutdown can abort a rank
    # ("terminate called without an active exception", pytorch issue 190489): seen once in CI without this.
    accelerator.end_training()


if __name__ == "__main__":
    main()
