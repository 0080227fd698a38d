"""The streaming tier (zero2-stream): frozen weights beyond the card's budget stream from host memory, block by
block. On the CPU the "card" is host memory too, so what is checked here is the schedule and the math: a run with
every frozen block streamed equals the same run with every block resident bit for bit (the same kernels on the
same weights), with gradient checkpointing (reentrant or not) and without; it trains as plain accelerate does;
after the first step each block's copy was started before the block needed it; a checkpoint resumes exactly; the
frozen weights come back whole in state_dict(). The overlap of copies and computation is the GPU's (docs/gpu.md)."""

import json
import sys
from pathlib import Path

import pytest

from accel_ds_fix import deepspeed_config
from accel_ds_fix.errors import ConfigError
from accel_ds_fix.memory import model as memory_model, tiers
from accel_ds_fix.streaming import blocks
from conftest import clean_env, free_port, remove_shm_segments, result, run

RUNS = Path(__file__).resolve().parent / "stream_runs.py"
LAYERS = 6  # stream_runs.py's blocks with frozen weights


def stream_run(**options):
    port = free_port()
    try:
        proc = run([sys.executable, str(RUNS), json.dumps(options)], env=clean_env(MASTER_PORT=str(port)))
    finally:
        remove_shm_segments(port)
    return result(proc), proc.stderr


def trained(r):
    return [x for v in r["lora"].values() for x in v] + [x for v in r["text_encoder"] for x in v]


@pytest.mark.parametrize("checkpointing", ["nonreentrant", "reentrant", "none"])
def test_streamed_blocks_train_bit_for_bit_as_resident_ones(checkpointing):
    """About 40 s. Five steps, a decaying learning rate, clipping to 1.0 by the script's clip_grad_norm_."""
    streamed, said = stream_run(on_card=0, checkpointing=checkpointing)
    resident, _ = stream_run(on_card=100, checkpointing=checkpointing)
    assert streamed["losses"] == resident["losses"] and streamed["norms"] == resident["norms"]
    assert trained(streamed) == trained(resident)
    assert resident["counters"] == []  # 100 GiB keep every block on the card: nothing streams
    [counters] = streamed["counters"]
    assert counters["blocks"] == LAYERS
    # the order of a step: each block for the forward, and for the backward (the last block of the forward is
    # kept for the backward's first) -- 2 x 6 - 1 -- plus the first block again for the next step
    assert counters["order"] == 2 * LAYERS
    # the first step loads each block when needed (no order yet), the second step's first block too (without
    # reentrant checkpointing, whose first forward keeps none); every other load was started before its block
    # needed it: 4 steps x 12 loads with at most 1 wait
    assert counters["waited"] <= counters["order"] + 1
    assert counters["loads"] <= 5 * counters["order"]
    assert streamed["frozen_unchanged"]  # state_dict() gives the frozen weights whole, unchanged
    assert f"streaming frozen weights: {LAYERS} of {LAYERS} frozen blocks" in said


def test_streamed_training_is_plain_accelerates_and_resumes_exactly():
    """About 45 s. The same training without DeepSpeed (fp32: ZeRO-2's own rounding apart), with clipping at 1.0 and
    without; a save_state and load_state after step 2 into a folder that does not exist yet, resumed to step 5 as if
    never stopped."""
    streamed, _ = stream_run(on_card=0)
    plain, _ = stream_run()
    assert max(abs(a - b) for a, b in zip(streamed["losses"], plain["losses"])) < 2e-6
    assert max(abs(a - b) for a, b in zip(trained(streamed), trained(plain))) < 2e-6
    assert trained(streamed) != trained(stream_run(on_card=0, steps=4)[0])  # the LoRA trains: step 5 changes it
    # clipping off on both sides (a max_norm no gradient reaches, and the config's gradient_clipping at it)
    unclipped, _ = stream_run(on_card=0, clip=1000.0)
    plain_unclipped, _ = stream_run(clip=1000.0)
    assert max(abs(a - b) for a, b in zip(trained(unclipped), trained(plain_unclipped))) < 2e-6
    assert max(abs(a - b) for a, b in zip(trained(unclipped), trained(streamed))) > 1e-4  # clipping was at work
    resumed, _ = stream_run(on_card=0, resume_at=2)
    assert resumed["losses"] == streamed["losses"] and trained(resumed) == trained(streamed)
    assert resumed["frozen_unchanged"]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_streamed_blocks_skip_an_overflowing_step_and_accumulate_as_resident_ones(accumulation):
    """About 16 s each. Six batches, one or two a step (DeepSpeed's paths without and with accumulation on the
    host: two forwards and backwards stream before one optimizer step), a decaying learning rate, clipping at 1.0,
    and a NaN loss in the third batch: DeepSpeed skips that step, streamed as resident, and the rest trains bit for
    bit."""
    streamed, _ = stream_run(on_card=0, steps=6, accumulation=accumulation, nan_at=2)
    resident, _ = stream_run(on_card=100, steps=6, accumulation=accumulation, nan_at=2)
    assert streamed["skipped_steps"] == resident["skipped_steps"] == 1
    assert len(streamed["norms"]) == 6 // accumulation
    assert streamed["norms"][0] > 1.0 or accumulation > 1  # one batch a step: clipping at work in the first
    assert repr(streamed["losses"]) == repr(resident["losses"]) and repr(streamed["norms"]) == repr(resident["norms"])
    assert trained(streamed) == trained(resident)
    assert all(x == x for x in trained(streamed))  # no NaN reached the weights
    [counters] = streamed["counters"]
    assert counters["blocks"] == LAYERS and resident["counters"] == []
    # each batch's forward and backward load every block but the one kept between them: more than five batches'
    # worth, so all six streamed, the skipped one and those that only accumulate too
    assert 5 * (2 * LAYERS - 1) < counters["loads"] <= 6 * counters["order"]


@pytest.mark.quick
def test_the_streaming_section_is_read_once_and_refused_where_it_cannot_apply():
    config = tiers.BY_NAME["zero2-stream"].deepspeed_config()
    s = deepspeed_config.streaming(config)
    assert s.enabled and s.on_card is None and s.reserve == 4 * 2**30
    assert memory_model.Settings.from_config(config, "bf16").stream
    with pytest.raises(ConfigError, match="frozen_on_card_gib in the DeepSpeed config is 'lots'"):
        deepspeed_config.streaming({"accel_ds_fix": {"stream_frozen_weights": True, "frozen_on_card_gib": "lots"}})
    with pytest.raises(ConfigError, match="streaming frozen weights goes with ZeRO stage 0, 1 or 2"):
        deepspeed_config.streaming({"zero_optimization": {"stage": 3}, "accel_ds_fix": {"stream_frozen_weights": True}})
    with pytest.raises(ConfigError, match="it takes 'nvme_optimizer_ram_gib', 'stream_frozen_weights'"):
        deepspeed_config.streaming({"accel_ds_fix": {"stream": True}})


@pytest.mark.quick
def test_blocks_are_the_children_of_the_outermost_lists_and_the_first_ones_stay_on_the_card():
    import torch

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.inner = torch.nn.ModuleList([torch.nn.Linear(4, 4)])  # half the layer: the layer is not cut there
            self.adapter = torch.nn.Linear(4, 1)  # trainable: never streams

    model = torch.nn.Module()
    model.embed = torch.nn.Linear(4, 4)  # outside every list: stays on the card
    model.layers = torch.nn.ModuleList([Layer() for _ in range(3)])
    model.requires_grad_(False)
    for layer in model.layers:
        layer.adapter.requires_grad_(True)
    found = blocks.find(model, "m", lambda p: p.numel() * 2)
    assert [b.name for b in found] == ["m.layers.0", "m.layers.1", "m.layers.2"]
    assert all(len(b.params) == 4 and b.nbytes == 2 * 40 for b in found)  # two Linear(4, 4): weights and biases
    resident, streamed = blocks.split(found, 170)
    assert [b.name for b in resident] == ["m.layers.0", "m.layers.1"] and [b.name for b in streamed] == ["m.layers.2"]


@pytest.mark.quick
def test_a_block_too_large_is_cut_at_its_inner_lists_as_plan_cuts_the_checkpoint(tmp_path):
    """SDXL's up_blocks.0 holds 47 % of the UNet: two of it on the card at once would fill an 8 GB card. A block
    above 1/16 of its model whose inner lists hold nearly all of it is cut there, again and again (an attention's
    transformer_blocks); a block whose lists hold little (Flux's attn.to_out.0) stays whole, a list of lists
    (kohya's SDXL UNet) is cut always. `plan` cuts the checkpoint's names the same way."""
    import torch
    from safetensors.torch import save_file

    from accel_ds_fix.memory import model_files, pipelines

    def linear(n):
        return torch.nn.Linear(n, n, bias=False)

    class Attention(torch.nn.Module):  # a Transformer2DModel: proj_in, a list of transformer blocks
        def __init__(self, layers):
            super().__init__()
            self.proj_in = linear(4)
            self.transformer_blocks = torch.nn.ModuleList([linear(16) for _ in range(layers)])

    class UpBlock(torch.nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.resnets = torch.nn.ModuleList([linear(8), linear(8)])
            self.attentions = torch.nn.ModuleList([Attention(layers), Attention(layers)])

    class FluxLike(torch.nn.Module):  # most of it outside its small inner list
        def __init__(self):
            super().__init__()
            self.to_q = linear(16)
            self.to_out = torch.nn.ModuleList([linear(2)])

    unet = torch.nn.Module()
    unet.conv_in = linear(64)  # outside every list: counts in the model's size (11,920 elements in all)
    unet.up_blocks = torch.nn.ModuleList([UpBlock(10), UpBlock(1), UpBlock(1), UpBlock(1)])
    unet.single = torch.nn.ModuleList([FluxLike() for _ in range(2)])
    unet.kohya = torch.nn.ModuleList([torch.nn.ModuleList([linear(2), linear(2)])])
    unet.requires_grad_(False)
    found = blocks.find(unet, "unet", lambda p: p.numel() * 2)
    names = [b.name[len("unet."):] for b in found]
    assert names[:4] == ["up_blocks.0.resnets.0", "up_blocks.0.resnets.1", "up_blocks.0.attentions.0.transformer_blocks.0",
                         "up_blocks.0.attentions.0.transformer_blocks.1"], names
    assert "up_blocks.1" in names and "single.0" in names and "kohya.0.0" in names and "kohya.0" not in names
    assert not any(n.startswith("up_blocks.0.attentions.0.proj_in") for n in names)  # outside the cut: on the card
    assert all(isinstance(b.module, torch.nn.Module) for b in found)
    # the plan reads the same cut from the weights' names in a checkpoint
    folder = tmp_path / "unet"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, str(folder / "model.safetensors"))
    largest = pipelines._largest_block(model_files.folder_shapes(str(folder)))
    assert largest == max(b.nbytes // 2 for b in found) == 2 * 8 * 8 + 2 * (4 * 4 + 16 * 16)  # up_blocks.1: whole


@pytest.mark.quick
def test_the_card_keeps_first_what_computes_least_for_its_bytes():
    """The text encoders (prepared: twice a step, little computation) before T5 and the VAE (beside, once a step)
    before the denoiser, whose last blocks stream; the plan's split keeps the same."""
    from accel_ds_fix.memory import model as memory_model
    from accel_ds_fix.streaming import engine_build

    def model(label, n, size):
        return [blocks.Block(None, f"{label}.{i}", [], size) for i in range(n)]

    denoiser, clip, t5 = model("transformer", 4, 100), model("clip", 2, 10), model("t5", 2, 50)
    order = engine_build.keep_first([(denoiser, True), (clip, True), (t5, False)])
    assert [b.name for b in order] == ["clip.0", "clip.1", "t5.0", "t5.1", "transformer.0", "transformer.1",
                                       "transformer.2", "transformer.3"]
    resident, streamed = blocks.split(order, 320)
    assert [b.name for b in streamed] == ["transformer.2", "transformer.3"]

    # 1000 prepared parameters in bf16, 100 of them the text encoders', T5 beside them 300 bytes, 500 kept
    work = memory_model.Workload(params=1000, trainable=0, frozen_on_gpu=300, frozen_smaller_prepared=200)
    split = memory_model.stream_split(work, memory_model.Settings(stage=2, half_bytes=2, frozen_on_card=500))
    assert split.streamed_beside == 0 and split.streamed_prepared == 2000 - 200 - 0 and split.kept == 500
    split = memory_model.stream_split(work, memory_model.Settings(stage=2, half_bytes=2, frozen_on_card=400))
    assert split.streamed_beside == 100 and split.streamed_prepared == 1800 and split.prepared == 1800


def test_a_streamed_checkpoint_resumes_under_the_other_tiers_and_theirs_under_streaming(tmp_path):
    """About 30 s. A save_state under zero2-stream (every block streamed) before step 2, loaded by the same script
    under zero2-offload (the same ZeRO layout, nothing streamed) and under zero3-offload (another layout: the
    universal copy); and a zero3-offload checkpoint loaded under zero2-stream. Each continues as the run that
    saved it: the frozen weights a checkpoint holds are the host copies, whole."""
    streamed, _ = stream_run(on_card=0, save_at=2, folder=str(tmp_path / "s"))
    checkpoint = str(tmp_path / "s" / "checkpoint")
    for tier in ("zero2-offload", "zero3-offload"):
        resumed, said = stream_run(tier=tier, load_from=checkpoint, first_step=2)
        assert max(abs(a - b) for a, b in zip(resumed["losses"], streamed["losses"][2:])) < 1e-6, (tier, said[-2000:])
        assert len(resumed["losses"]) == 3 and resumed["frozen_unchanged"]
    zero3, _ = stream_run(tier="zero3-offload", save_at=2, folder=str(tmp_path / "z"))
    resumed, said = stream_run(on_card=0, load_from=str(tmp_path / "z" / "checkpoint"), first_step=2)
    assert max(abs(a - b) for a, b in zip(resumed["losses"], zero3["losses"][2:])) < 1e-6, said[-2000:]
    assert resumed["counters"][0]["blocks"] == LAYERS and resumed["frozen_unchanged"]


def test_two_processes_stream_each_their_own_copy_and_train_as_one(tmp_path):
    """About 30 s. `accelerate launch --num_processes 2` (gloo) on the CPU, every process on the same batches:
    every block streamed in each process equals every block resident bit for bit, and one process's run within
    fp32's rounding of the gradients' average."""
    def launched(on_card):
        port, out = free_port(), tmp_path / f"{on_card}.json"
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--zero_stage", "2", "--main_process_port",
                  str(port), str(RUNS), json.dumps({"on_card": on_card, "out": str(out)})]
        try:
            run(launch, env=clean_env())
        finally:
            remove_shm_segments(port)
        return json.loads(out.read_text())

    streamed, resident = launched(0), launched(100)
    assert streamed["losses"] == resident["losses"] and trained(streamed) == trained(resident)
    assert streamed["counters"][0]["blocks"] == LAYERS and resident["counters"] == []
    alone, _ = stream_run(on_card=0)
    assert max(abs(a - b) for a, b in zip(streamed["losses"], alone["losses"])) < 1e-6


def test_a_streamed_save_killed_half_way_leaves_the_previous_checkpoint_to_resume(tmp_path):
    """About 15 s. Saves before steps 1 and 3 into one folder under zero2-stream (every block streamed); the second
    killed with SIGKILL once two of its files are written: load_state of the folder resumes the first save and the
    run continues as the uninterrupted one, bit for bit."""
    folder = tmp_path / "run"
    options = {"on_card": 0, "save_steps": [1, 3], "folder": str(folder)}
    counted = tmp_path / "files.txt"
    whole, _ = stream_fault(f"count:{counted}", folder / "checkpoint", options)
    per_save = len(counted.read_text().splitlines()) // 2
    assert per_save > 2  # a DeepSpeed checkpoint, the fix's manifest and accelerate's files
    killed, _ = stream_fault(f"closed:{per_save + 2}", folder / "checkpoint", options, check=False)
    assert killed is None  # the process died in its second save, before printing anything
    resumed, said = stream_run(on_card=0, load_from=str(folder / "checkpoint"), first_step=1)
    assert resumed["losses"] == whole["losses"][1:] and trained(resumed) == trained(whole), said[-2000:]
    assert resumed["frozen_unchanged"]


def stream_fault(fault, watched, options, check=True):
    """stream_runs.py under tests/crash_save_child.py's fault ``fault`` in saves into ``watched``."""
    port = free_port()
    env = clean_env(MASTER_PORT=str(port), ACCEL_DS_FIX_TEST_FAULT=fault, ACCEL_DS_FIX_TEST_FAULT_DIR=str(watched))
    child = Path(__file__).resolve().parent / "crash_save_child.py"
    try:
        proc = run([sys.executable, str(child), str(RUNS), json.dumps(options)], env=env, check=check)
    finally:
        remove_shm_segments(port)
    return (result(proc) if proc.returncode == 0 else None), proc.stderr
