"""Save/load hooks as real scripts write them (tests/hook_patterns.py replays diffusers' dreambooth and LoRA
scripts and kohya's train_network.py): they train, checkpoint and resume exactly, under ZeRO-2 and ZeRO-3."""

import json
import sys

import pytest
import torch

from conftest import ROOT, clean_env, run

PATTERNS = ROOT / "tests" / "hook_patterns.py"


def pattern_run(tmp_path, *args):
    """An uninterrupted run that saves after 3 steps, then a new process resuming from that checkpoint."""
    ckpt, first, resumed = tmp_path / "ckpt", tmp_path / "first.json", tmp_path / "resumed.json"
    run([sys.executable, PATTERNS, *args, "--steps", "6", "--save-at", "3", "--checkpoint", ckpt, "--out", first],
        warm=True)
    proc = run([sys.executable, PATTERNS, *args, "--steps", "3", "--resume", ckpt, "--out", resumed], warm=True)
    return json.loads(first.read_text()), json.loads(resumed.read_text()), ckpt, proc


@pytest.mark.parametrize("stage", ["2", "3"])
def test_diffusers_dreambooth_hooks_save_each_model_and_resume(tmp_path, stage):
    first, resumed, ckpt, _ = pattern_run(tmp_path, "diffusers", "--zero-stage", stage)
    # One weights entry per model, as accelerate gives without DeepSpeed: one weights.pop() per model works.
    assert first["save_hook"] == [{"classes": ["TinyUNet", "CLIPTextModel"], "weights": 2}]
    # DeepSpeed's checkpoint holds the weights: accelerate writes no model files of its own (nothing twice).
    assert first["accelerate_model_files"] == []
    # Each subfolder the hook wrote holds that model's full weights (ZeRO-3: gathered, never shape [0]).
    from safetensors.torch import load_file

    unet = torch.load(ckpt / "unet" / "weights.pt", weights_only=True)
    text_encoder = load_file(str(ckpt / "text_encoder" / "model.safetensors"))
    assert sorted(unet) == ["cond.bias", "cond.weight", "inp.bias", "inp.weight", "out.bias", "out.weight"]
    assert unet["inp.weight"].shape == (16, 8)
    assert len(text_encoder) > 20 and all(t.numel() > 0 for t in text_encoder.values())
    # The load hook got the models (in argument order), popped them, built the text encoder again with
    # from_pretrained (whole, although transformers knows the ZeRO-3 config) and loaded it into the model.
    assert resumed["load_hook"] == [["TinyUNet", "CLIPTextModel"]]
    assert resumed["hook_write_visible"] == [True, True]
    assert resumed["losses"] == first["losses"][3:]


@pytest.mark.parametrize("stage, models", [("2", "2"), ("3", "3")], ids=["zero2-two-models", "zero3-three-models"])
def test_peft_lora_hooks_resume(tmp_path, stage, models):
    first, resumed, ckpt, _ = pattern_run(tmp_path, "lora", "--zero-stage", stage, "--models", models)
    classes = ["TinyUNet", "TinyTextEncoder", "TinyTextEncoder2"][: int(models)]
    assert first["save_hook"] == [{"classes": classes, "weights": int(models)}]
    adapters = torch.load(ckpt / "lora_tinyunet.pt", weights_only=True)
    assert sorted(adapters) == [f"{m}.lora_{ab}.weight" for m in ("cond", "inp", "out") for ab in "AB"]
    assert all(t.numel() > 0 for t in adapters.values())
    # The common load hook (`while models: model = models.pop()`, then set_peft_model_state_dict) works.
    assert resumed["load_hook"] == [classes]
    assert resumed["hook_write_visible"] == [True] * int(models)
    assert resumed["losses"] == first["losses"][3:]


def test_kohya_network_hooks_pop_by_index(tmp_path):
    first, resumed, _, _ = pattern_run(tmp_path, "kohya", "--zero-stage", "2")
    assert first["save_hook"] == [{"classes": ["TinyUNet", "TinyTextEncoder", "Network"], "weights": 3, "left": 1}]
    assert resumed["load_hook"] == [["TinyUNet", "TinyTextEncoder", "Network"]]
    assert resumed["train_state"] == {"current_step": 3}
    assert resumed["losses"] == first["losses"][3:]


@pytest.mark.parametrize("stage", ["2", "3"])
def test_trainability_changed_after_prepare_resumes_and_is_said(tmp_path, stage):
    # The embedding turns trainable after prepare() (and after load_state on resume): DeepSpeed stored it as
    # frozen, finds it trainable at load time, and would raise KeyError in load_module_state_dict. Outside the
    # script's optimizer (diffusers' LoRA scripts, for gradient checkpointing) no optimizer would update it, with
    # DeepSpeed or without: nothing to say. Handed to the optimizer frozen, it would train without DeepSpeed and
    # does not under it: said once.
    (tmp_path / "outside").mkdir(), (tmp_path / "inside").mkdir()
    first, resumed, _, proc = pattern_run(tmp_path / "outside", "lora", "--zero-stage", stage, "--unfreeze-after-prepare")
    assert resumed["losses"] == first["losses"][3:]
    assert "made trainable after accelerator.prepare()" not in proc.stderr
    first, resumed, _, proc = pattern_run(tmp_path / "inside", "lora", "--zero-stage", stage, "--unfreeze-after-prepare",
                                          "--embedding-in-optimizer")
    assert resumed["losses"] == first["losses"][3:]
    said = [line for line in proc.stderr.splitlines() if "made trainable after accelerator.prepare()" in line]
    assert len(said) == 1
    assert "(models.tinytextencoder.embed.weight): DeepSpeed's optimizer does not own them, so they are not updated" in said[0]


@pytest.mark.parametrize("stage", ["2", "3"])
def test_save_state_on_the_main_process_alone_is_saved_by_every_process(tmp_path, stage):
    # diffusers' DreamBooth scripts up to v0.40 call save_state under `if accelerator.is_main_process:`; each
    # process writes its own part of a DeepSpeed checkpoint, so the main process waited forever. It is handed to
    # the next step, where every process saves it, with each one's random states of the script's line.
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
              "--zero_stage", stage, "--mixed_precision", "no", "--num_machines", "1"]
    ckpt, first, resumed = tmp_path / "out" / "checkpoint-3", tmp_path / "first.json", tmp_path / "resumed.json"
    args = ["diffusers", "--zero-stage", stage, "--save-on-main-only"]
    proc = run([*launch, PATTERNS, *args, "--steps", "6", "--save-at", "3", "--checkpoint", ckpt, "--out", first],
               timeout=300)
    assert "was called on the main process alone" in proc.stderr and "every process" in proc.stderr
    assert (ckpt / "accel_ds_fix.json").is_file()  # whole: its manifest lists what both processes wrote
    run([*launch, PATTERNS, *args, "--steps", "3", "--resume", ckpt, "--out", resumed], timeout=300)
    first, resumed = json.loads(first.read_text()), json.loads(resumed.read_text())
    assert len(first["losses"]) == 6 and resumed["losses"] == first["losses"][3:]


def test_two_processes_zero3_lora_export_on_the_main_process_alone(tmp_path):
    # Every diffusers script exports after training on the main process alone; under ZeRO-3 each weight is
    # partitioned across the processes, and a gather there alone waited for the others, which had left.
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
              "--zero_stage", "3", "--mixed_precision", "no", "--num_machines", "1"]
    out, ckpt = tmp_path / "r.json", tmp_path / "ckpt"
    proc = run([*launch, PATTERNS, "lora", "--zero-stage", "3", "--steps", "3", "--export-on-main-only",
                "--save-at", "2", "--checkpoint", ckpt, "--out", out], timeout=300)
    export = json.loads(out.read_text())["export_alone"]
    # the save hook's read on the main process runs inside the fix's gather on every process: whole, no wait
    saved = torch.load(ckpt / "lora_tinyunet.pt", weights_only=True)
    assert len(saved) == 6 and all(v.numel() > 0 for v in saved.values())
    assert proc.stderr.index("export on the main process alone begins") < proc.stderr.index("on process 0 alone")
    assert export["equal"] and len(export["keys"]) == 6  # the trained weights: whole, as every process reads them
    assert export["lora_B_nonzero"] == 3
    # the frozen base stays partitioned: shape-[0] shards in a state dict read alone, said once
    assert export["frozen_shapes"] and all(shape == [0] for shape in export["frozen_shapes"].values())
    assert "state_dict() of TinyUNet on process 0 alone: its" in proc.stderr


def test_two_processes_zero3_validation_on_the_main_process_alone_is_named(tmp_path):
    # diffusers' scripts validate on the main process alone; under ZeRO-3 its forward gathers every weight from
    # every process, and waited forever for processes that had trained on.
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
              "--zero_stage", "3", "--mixed_precision", "no", "--num_machines", "1"]
    out = tmp_path / "r.json"
    proc = run([*launch, PATTERNS, "diffusers", "--zero-stage", "3", "--steps", "4", "--validate-on-main-only",
                "--out", out], check=False, timeout=300, env=clean_env(ACCEL_DS_FIX_WAIT_S="5"))
    assert proc.returncode != 0 and not out.exists()
    assert ("ConfigError: accel_ds_fix: CLIPTextModel runs a forward (without gradients: a validation?) on "
            "process 0, and process(es) 1 did not run it within 5 s") in proc.stderr
    assert proc.stderr.count("runs a forward (without gradients") == 1  # the forward on every process passed


def test_two_processes_zero3_save_hook_on_the_main_process_only(tmp_path):
    # diffusers saves in its hook on the main process only; gathering ZeRO-3 weights there alone would hang.
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
              "--zero_stage", "3", "--mixed_precision", "no", "--num_machines", "1"]
    ckpt, first, resumed = tmp_path / "ckpt", tmp_path / "first.json", tmp_path / "resumed.json"
    args = ["diffusers", "--zero-stage", "3"]
    run([*launch, PATTERNS, *args, "--steps", "6", "--save-at", "3", "--checkpoint", ckpt, "--out", first], timeout=900)
    run([*launch, PATTERNS, *args, "--steps", "3", "--resume", ckpt, "--out", resumed], timeout=900)
    first, resumed = json.loads(first.read_text()), json.loads(resumed.read_text())
    unet = torch.load(ckpt / "unet" / "weights.pt", weights_only=True)
    assert unet["inp.weight"].shape == (16, 8) and unet["cond.weight"].shape == (16, 16)
    assert resumed["losses"] == first["losses"][3:]
