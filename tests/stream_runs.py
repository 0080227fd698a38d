"""One streaming run per process: `python tests/stream_runs.py '{"on_card": 0, ...}'`. Prints one JSON line (the
last line of stdout). A LoRA-shaped training as diffusers' Flux and SD3 LoRA scripts run it, in small: a frozen
base whose layers sit in a ModuleList with a trainable low-rank adapter in each, a trained text encoder, and a
frozen transformers T5 encoder the script moves to the card before prepare() and calls under no_grad each step;
one optimizer, a decaying learning rate, clipping. Real accelerate + DeepSpeed (ZeRO-2, optimizer on the CPU),
on the CPU (one process, or the processes of a launcher), fp32. ``on_card``: GiB of frozen weights kept on the
"card" (None: as the config ships, as much as the card leaves, which streams nothing without a GPU); ``tier``:
another shipped tier instead of zero2-stream; neither: plain accelerate, no DeepSpeed. ``save_at`` (or
``save_steps``) / ``load_from`` with ``first_step``: a checkpoint written before that step into ``folder``, or the
run begun there from one. ``nan_at``: that batch's loss made NaN (DeepSpeed skips the step); ``accumulation``:
batches a step (``acc.accumulate``)."""

import contextlib
import json
import os
import sys
import tempfile

import torch
import torch.utils.checkpoint
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, set_seed

import accel_ds_fix  # noqa: F401
from accel_ds_fix.memory import tiers

WIDTH, RANK, LAYERS, TOKENS, VOCAB = 64, 4, 6, 8, 100


class LoraLayer(torch.nn.Module):
    """A frozen layer with a trainable adapter, as peft's LoRA wraps one."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(WIDTH, WIDTH)
        self.lora_A = torch.nn.Linear(WIDTH, RANK, bias=False)
        self.lora_B = torch.nn.Linear(RANK, WIDTH, bias=False)
        torch.nn.init.normal_(self.lora_B.weight, std=0.02)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = LoraLayer()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(), torch.nn.Linear(2 * WIDTH, WIDTH))
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, x, cond):
        x = x + self.attn(self.norm(x) + cond)
        return x + self.mlp(x)


class Base(torch.nn.Module):
    def __init__(self, checkpointing):
        super().__init__()
        self.proj_in = torch.nn.Linear(WIDTH, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.proj_out = torch.nn.Linear(WIDTH, WIDTH)
        self.checkpointing = checkpointing

    def forward(self, x, cond):
        x = self.proj_in(x)
        for block in self.blocks:
            if self.checkpointing == "none":
                x = block(x, cond)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, cond, use_reentrant=self.checkpointing == "reentrant")
        return self.proj_out(x)


class TextEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, ids):
        return self.proj(self.embed(ids)).mean(1, keepdim=True)


def t5():
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=16, d_ff=2 * WIDTH, num_layers=3, num_heads=4)
    return T5EncoderModel(config).eval()


def config_for(tier, on_card, clip, accumulation=1):
    config = tiers.BY_NAME[tier].deepspeed_config()
    if tier == "zero2-stream" and on_card is not None:
        config["accel_ds_fix"]["frozen_on_card_gib"] = on_card
    config["gradient_clipping"] = clip
    config["train_micro_batch_size_per_gpu"] = 2
    config["gradient_accumulation_steps"] = accumulation
    return config


def main(options):
    if "WORLD_SIZE" not in os.environ:  # one process; under a launcher, its own
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"
    steps, clip, accumulation = options.get("steps", 5), options.get("clip", 1.0), options.get("accumulation", 1)
    if "on_card" not in options and "tier" not in options:
        acc = Accelerator(gradient_accumulation_steps=accumulation)
    else:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        config = config_for(options.get("tier", "zero2-stream"), options.get("on_card"), clip, accumulation)
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    set_seed(0)
    base, text_encoder, frozen_t5 = Base(options.get("checkpointing", "nonreentrant")), TextEncoder(), t5()
    initial = {k: v.clone() for k, v in base.state_dict().items()}
    base.requires_grad_(False)
    frozen_t5.requires_grad_(False)
    for layer in (b.attn for b in base.blocks):
        layer.lora_A.requires_grad_(True)
        layer.lora_B.requires_grad_(True)
    frozen_t5.to(acc.device)  # as diffusers' scripts move the frozen T5 before prepare()
    trained = [p for p in [*base.parameters(), *text_encoder.parameters()] if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / (2 * steps))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (2, TOKENS), generator=g), torch.randn(2, TOKENS, WIDTH, generator=g))
               for _ in range(steps)]
    base, text_encoder, optimizer, scheduler = acc.prepare(base, text_encoder, optimizer, scheduler)
    losses, norms = [], []
    resume_at, save_at, first = options.get("resume_at"), options.get("save_at"), options.get("first_step", 0)
    folder = options.get("folder") or tempfile.mkdtemp()
    for step, (ids, x) in enumerate(batches):
        if step < first:
            continue
        if step == first and options.get("load_from"):
            acc.load_state(options["load_from"])
        if step == save_at or step in options.get("save_steps", ()):
            acc.save_state(os.path.join(folder, "checkpoint"))  # the same folder each time, as scripts save
        if resume_at is not None and step == resume_at:
            acc.save_state(os.path.join(folder, "new", "checkpoint"))  # a folder that does not exist yet
            acc.load_state(os.path.join(folder, "new", "checkpoint"))
        with acc.accumulate(base, text_encoder) if accumulation > 1 else contextlib.nullcontext():
            with torch.no_grad():
                frozen = frozen_t5(input_ids=ids.to(acc.device)).last_hidden_state.mean(1, keepdim=True)
            loss = torch.nn.functional.mse_loss(base(x.to(acc.device), text_encoder(ids.to(acc.device)) + frozen),
                                                torch.zeros_like(x).to(acc.device))
            if step == options.get("nan_at"):
                loss = loss * float("nan")
            acc.backward(loss)
            if acc.sync_gradients:  # as scripts clip: at the step that updates the weights
                norms.append(float(acc.clip_grad_norm_([*base.parameters(), *text_encoder.parameters()], clip)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    unwrapped = accel_ds_fix.unwrap(base)
    state = {k: v.detach().float().cpu() for k, v in unwrapped.state_dict().items()}
    lora = {k: v for k, v in state.items() if "lora" in k}
    frozen_same = all(torch.equal(state[k], initial[k]) for k in state if "lora" not in k)
    from accel_ds_fix.streaming.engine_build import streamers

    counters = [{"blocks": len(s.blocks), "loads": s.loads, "waited": s.waited, "order": len(s.order)}
                for s in streamers]
    if not acc.is_main_process:
        return
    engine = getattr(base, "_self_engine", None)
    report = json.dumps({"losses": losses, "norms": norms, "skipped_steps": getattr(engine, "skipped_steps", None),
                         "counters": counters, "frozen_unchanged": frozen_same,
                         "lora": {k: v.flatten().tolist() for k, v in lora.items()},
                         "text_encoder": [v.flatten().tolist()
                                          for v in accel_ds_fix.unwrap(text_encoder).state_dict().values()]})
    if options.get("out"):  # under a launcher the processes' output may interleave: a file of its own
        with open(options["out"], "w", encoding="utf-8") as f:
            f.write(report)
    print(report)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
