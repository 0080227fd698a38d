"""save_state/load_state resume exactly; every model exports its own full weights, ZeRO-3 included."""

import json
import sys

import pytest
import torch

from conftest import SCENARIOS, run

STAGES = {"zero2": ["--zero-stage", "2"], "zero3": ["--zero-stage", "3"]}


@pytest.mark.parametrize("stage", STAGES.values(), ids=STAGES.keys())
def test_resume_in_new_process_continues_exactly(train, tmp_path, stage):
    uninterrupted = train(*stage, "--import-fix", "--steps", "6")["losses"]
    first = train(*stage, "--import-fix", "--steps", "3", "--save-state", tmp_path / "ckpt")["losses"]
    rest = train(*stage, "--import-fix", "--resume", tmp_path / "ckpt", "--first-step", "3", "--steps", "3")["losses"]
    assert first == uninterrupted[:3]
    assert rest == uninterrupted[3:]
    saved = json.loads((tmp_path / "ckpt" / "accel_ds_fix.json").read_text())
    assert list(saved["models"]) == ["tinyunet", "tinytextencoder"]


@pytest.mark.parametrize("stage", ["2", "3"], ids=["zero2-offload", "zero3-offload"])
def test_a_resume_under_cpu_offload_continues_exactly_from_any_step(train, tmp_path, stage):
    """DeepSpeed's CPU Adam keeps beta**step as a float32 product, which a new process would start with pow(): a save
    after step 2 resumed 6e-7 off the run that went on (issue 41, item 6). Saves after steps 1, 2 and 3, each
    resumed to step 6 (the example's learning rate decays, its gradients are clipped at 1.0)."""
    args = ["--zero-stage", stage, "--offload", "cpu", "--import-fix"]
    uninterrupted = train(*args, "--steps", "6")["losses"]
    for saved_at in (1, 2, 3):
        ckpt = tmp_path / f"ckpt{saved_at}"  # a folder that does not exist yet, as scripts save
        train(*args, "--steps", str(saved_at), "--save-state", ckpt)
        rest = train(*args, "--resume", ckpt, "--first-step", str(saved_at), "--steps", str(6 - saved_at))["losses"]
        assert rest == uninterrupted[saved_at:], saved_at


def load(path):
    if path.is_dir():
        path = path / "pytorch_model.bin"
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("stage", STAGES.values(), ids=STAGES.keys())
def test_exports_hold_every_trained_weight(train, tmp_path, stage):
    fixed = train(*stage, "--import-fix", "--export", tmp_path / "fix")
    reference = train(*stage, "--reference", "--export", tmp_path / "ref")
    assert fixed["losses"] == reference["losses"]
    assert fixed["exported"] == {"tinyunet": "TinyUNet", "tinytextencoder": "TinyTextEncoder"}
    # Ground truth: accelerate's own export of the hand-written merged module (DeepSpeed's consolidation).
    truth = load(tmp_path / "ref" / "merged.get_state_dict.pt")
    assert len(truth) == 11  # 6 unet + 5 text encoder tensors
    for name in ("tinyunet", "tinytextencoder"):
        expected = {k[len(f"models.{name}.") :]: v for k, v in truth.items() if k.startswith(f"models.{name}.")}
        for how in ("get_state_dict.pt", "unwrap_model.pt", "save_model"):
            state = load(tmp_path / "fix" / f"{name}.{how}")
            assert sorted(state) == sorted(expected), (name, how)
            for key, value in expected.items():
                assert state[key].shape == value.shape and value.numel() > 0, (name, how, key)
                assert torch.equal(state[key].float(), value.float()), (name, how, key)


def test_resume_with_other_models_fails_before_loading(train, scenario, tmp_path):
    train("--zero-stage", "2", "--import-fix", "--steps", "2", "--save-state", tmp_path / "ckpt")
    proc = scenario("resume_other_models", str(tmp_path / "ckpt"), check=False)
    assert proc.returncode != 0
    assert (
        "cannot resume from " + str(tmp_path / "ckpt") + ": it holds tinyunet (TinyUNet), tinytextencoder "
        "(TinyTextEncoder), but this run merged tinyunet (TinyUNet), linear (Linear). in the checkpoint but not "
        "passed to prepare() now: tinytextencoder (TinyTextEncoder); passed to prepare() now but not in the "
        "checkpoint: linear (Linear). Nothing was loaded."
    ) in proc.stderr


def test_resume_from_checkpoint_without_manifest_is_refused(train, scenario, tmp_path):
    train("--zero-stage", "2", "--reference", "--steps", "2", "--save-state", tmp_path / "ckpt")
    proc = scenario("resume_other_models", str(tmp_path / "ckpt"), check=False)
    assert proc.returncode != 0
    assert "has no accel_ds_fix.json, so it was not saved by accelerator.save_state() from models merged" in proc.stderr


def test_hooks_without_merge_are_accelerates_own(scenario, tmp_path):
    out = json.loads(scenario("single_model_hooks", str(tmp_path / "ckpt")).stdout.strip().splitlines()[-1])
    assert out == {"stored_is_users_function": True, "models_is_accelerators_list": True, "weights": 0}


def test_hooks_clipping_and_free_memory(scenario, tmp_path):
    proc = scenario("hooks_and_helpers", str(tmp_path / "ckpt"))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["save_hook_models"] == ["TinyUNet", "TinyTextEncoder"]
    assert out["save_hook_isinstance"] == [True, True]
    assert out["save_hook_unwraps"] == [True, True]
    assert out["save_hook_weights"] == 2  # one entry per model, as accelerate gives without DeepSpeed
    assert out["load_hook_models"] == ["TinyUNet", "TinyTextEncoder"]  # the models, in argument order
    assert out["grad_norm_is_number"] is True
    assert out["freed"] == {"models": 0, "engine_wrapped": None, "returned": [None, None, None]}
    assert "not applied here" not in proc.stderr and "names 0 fewer" not in proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "accelerator.clip_grad_norm_() is applied" in line]
    assert len(notes) == 1  # once, though the script clips twice a step
    assert ("accelerator.clip_grad_norm_() is applied as without DeepSpeed: the engine's step clips to max_norm=0.5 "
            "over the parameters the script names, those outside DeepSpeed's optimizer counted too (steps without "
            "the call clip to 1: the DeepSpeed config's gradient_clipping is \"auto\", which accelerate fills with 1)"
            in notes[0])


@pytest.mark.parametrize("stage", ["2", "3"])
def test_state_and_weights_save_after_end_training(scenario, tmp_path, stage):
    # kohya's scripts call end_training() before their final save_state and model save; accelerate >= 0.34
    # destroys the process group there, which DeepSpeed's checkpointing (and ZeRO-3's gathering) need.
    out = json.loads(scenario("save_after_end_training", stage, str(tmp_path / "final")).stdout.strip().splitlines()[-1])
    assert "accel_ds_fix.json" in out["saved"] and "pytorch_model" in out["saved"]
    assert out["te_shapes"] == [[32, 16], [16, 16]]


@pytest.mark.parametrize("processes", [1, 2])
def test_a_wrapper_whose_models_are_called_and_saved_one_by_one_trains_and_saves_under_zero3(scenario, processes):
    # kohya's --deepspeed: one wrapper module prepared, its models called directly (DeepSpeed alone: "Sequence length
    # must be less than max_position_embeddings (0)" in CLIP's embeddings) and saved one by one after
    # end_training() (DeepSpeed alone: every weight an empty shard in the saved file), with two processes on the
    # main process alone (a gather there alone would wait for the other process for ever)
    def result(*flags):
        if processes == 1:
            return json.loads(scenario("wrapper_called_in_parts", *flags).stdout.strip().splitlines()[-1])
        proc = run([sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
                    "--zero_stage", "3", "--mixed_precision", "no", "--num_machines", "1", SCENARIOS,
                    "wrapper_called_in_parts", *flags], timeout=300)
        # each process prints its result; two may share a line of the launcher's output
        decoder, results, at = json.JSONDecoder(), [], proc.stdout.find('{"losses"')
        while at != -1:
            result, end = decoder.raw_decode(proc.stdout, at)
            results.append(result)
            at = proc.stdout.find('{"losses"', end)
        return next(r for r in results if r["weights"])  # the main process's

    parts, whole = result(), result("--reference")
    assert len(parts["losses"]) == 5 // processes + (5 % processes > 0) and parts["losses"] == whole["losses"]
    assert parts["weights"] == whole["weights"]
    assert parts["weights"]["tinytextencoder.embed.weight"] and len(parts["weights"]) == 11
    frozen = ["tinytextencoder.norm.bias", "tinytextencoder.norm.weight"]
    assert parts["changed"] == sorted(set(parts["weights"]) - set(frozen))  # every trained weight changed


def test_a_resume_short_of_host_memory_for_deepspeeds_load_stops_before_loading(scenario, tmp_path):
    # The load copies each process's Adam states out of its mapped ZeRO file (checkpoints/mapped_load.py): where the
    # host lacks the room for them, one message says so and what to do, before anything is loaded.
    ckpt = tmp_path / "ckpt"
    out = json.loads(scenario("load_short_of_memory", str(ckpt)).stdout.strip().splitlines()[-1])
    path = ckpt / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert out["size"] >= 8 * out["trained"] and out["size"] < path.stat().st_size  # the states, not the file
    assert out["refused"].startswith("accel_ds_fix: load_state copies this process's optimizer states "
                                     f"({out['size'] / 2**30:.1f} GiB, as the training's first step would allocate "
                                     f"them) out of {path} (mapped, not read whole) ")
    assert "Nothing was loaded; the checkpoint is unchanged." in out["refused"]
    assert f"`python -m accel_ds_fix convert-checkpoint {ckpt}`" in out["refused"]
