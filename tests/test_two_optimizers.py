"""Two optimizers in one prepare() (GAN-style scripts): one DeepSpeed engine per optimizer. The loops of
tests/gan_patterns.py (diffusers' train_vqgan.py, TiTok's trainers) train under ZeRO-1/2 with the per-step
losses and final weights of the same loop under plain accelerate; save_state / load_state resume exactly; what
one engine per optimizer cannot train is refused before anything is built."""

import json
import sys

import pytest

from conftest import ROOT, run

PATTERNS = ROOT / "tests" / "gan_patterns.py"


def pattern(tmp_path, name, *args, check=True):
    out = tmp_path / f"{name}-{abs(hash(args))}.json"
    proc = run([sys.executable, PATTERNS, name, *args, "--out", out], check=check, warm=True)
    return (json.loads(out.read_text()) if out.exists() else None), proc


def assert_close(a, b, rtol):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rtol * max(abs(x), abs(y), 1e-3), (a, b)


def assert_weights_close(a, b, atol):
    for model in a:
        for key in a[model]:
            flat_a = json.dumps(a[model][key])
            if atol == 0:
                assert flat_a == json.dumps(b[model][key]), (model, key)
            else:
                import torch

                assert torch.allclose(torch.tensor(a[model][key]), torch.tensor(b[model][key]), atol=atol), (model, key)


# fp32: the same arithmetic as without DeepSpeed, so the same numbers (measured: bit-equal under ZeRO-1 and 2).
# bf16: DeepSpeed trains bf16 weights with fp32 master copies where plain accelerate autocasts fp32 weights.
@pytest.mark.parametrize("stage, precision, accumulation", [(2, "no", 1), (1, "no", 2), (2, "bf16", 2)],
                         ids=["zero2-fp32-ga1", "zero1-fp32-ga2", "zero2-bf16-ga2"])
def test_vqgan_loop_equals_plain_accelerate(tmp_path, stage, precision, accumulation):
    common = ("--precision", precision, "--accumulation", str(accumulation), "--steps", "8")
    plain, _ = pattern(tmp_path, "vqgan", *common)
    ds, _ = pattern(tmp_path, "vqgan", "--deepspeed", "--zero-stage", str(stage), *common)
    phases = 8 // accumulation // 2
    assert len(ds["generator"]) == len(ds["discriminator"]) == 8 // 2
    # each engine stepped once per sync step of its own phase, never in the other's
    assert ds["engine_steps"] == [phases, phases]
    assert ds["lr"] == plain["lr"]  # each scheduler stepped with its own optimizer
    if precision == "no":
        assert ds["generator"] == plain["generator"] and ds["discriminator"] == plain["discriminator"]
        assert_weights_close(ds["weights"], plain["weights"], atol=0)
        # clip_grad_norm_ reports the norm of the engine owning the parameters given, as torch computes it
        assert_close(ds["generator_grad_norm"], plain["generator_grad_norm"], rtol=1e-5)
        assert_close(ds["discriminator_grad_norm"], plain["discriminator_grad_norm"], rtol=1e-5)
        assert len(ds["generator_grad_norm"]) == phases  # one per sync step of the phase
    else:
        assert_close(ds["generator"], plain["generator"], rtol=0.05)
        assert_close(ds["discriminator"], plain["discriminator"], rtol=0.05)
        assert_weights_close(ds["weights"], plain["weights"], atol=0.05)
    assert ds["generator"][0] != ds["generator"][-1]


def test_a_frozen_model_in_the_call_goes_with_the_first_engine(tmp_path):
    plain, _ = pattern(tmp_path, "vqgan", "--frozen-perceptual", "--steps", "4")
    ds, proc = pattern(tmp_path, "vqgan", "--frozen-perceptual", "--deepspeed", "--zero-stage", "2", "--steps", "4")
    assert "engine 1 (optimizer 1 (AdamW, argument 4 of prepare())): generator, conv2d;" in proc.stderr
    assert ds["generator"] == plain["generator"] and ds["discriminator"] == plain["discriminator"]
    assert ds["engine_steps"] == [2, 2]


def test_two_processes_train_as_one(tmp_path):
    # gloo, both processes on the same batches: the averaged gradients are one process's; constant learning rates
    # (accelerate steps a scheduler once per process)
    out = tmp_path / "two.json"
    run([sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
         "--zero_stage", "2", "--mixed_precision", "no", "--num_machines", "1", PATTERNS, "vqgan", "--deepspeed",
         "--accumulation", "2", "--constant-lr", "--out", out])
    two = json.loads(out.read_text())
    plain, _ = pattern(tmp_path, "vqgan", "--accumulation", "2", "--constant-lr")
    assert two["engine_steps"] == [2, 2]
    assert_close(two["generator"], plain["generator"], rtol=1e-6)
    assert_close(two["discriminator"], plain["discriminator"], rtol=1e-6)
    assert_weights_close(two["weights"], plain["weights"], atol=1e-6)


def test_titok_loop_with_cpu_offload_equals_plain_accelerate(tmp_path):
    plain, _ = pattern(tmp_path, "titok", "--steps", "4")
    ds, _ = pattern(tmp_path, "titok", "--deepspeed", "--zero-stage", "2", "--offload", "cpu", "--steps", "4")
    assert ds["engine_steps"] == [4, 4]
    # DeepSpeedCPUAdam in place of torch's AdamW (accelerate swaps it in under offload): float rounding only
    assert_close(ds["generator"], plain["generator"], rtol=1e-5)
    assert_close(ds["discriminator"], plain["discriminator"], rtol=1e-5)
    assert_weights_close(ds["weights"], plain["weights"], atol=1e-5)


def test_vqgan_save_state_and_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ("vqgan", "--deepspeed", "--zero-stage", "2", "--accumulation", "2")
    first, _ = pattern(tmp_path, *common, "--steps", "8", "--save-at", "4", "--checkpoint", str(ckpt),
                       "--save-model", str(tmp_path / "exported"))
    resumed, _ = pattern(tmp_path, *common, "--steps", "4", "--resume", str(ckpt))
    # the save hook got both models and two weights entries (it pops two), the load hook both models
    assert first["hooks"]["save"] == [{"classes": ["Generator", "Discriminator"], "weights": 2}]
    assert resumed["hooks"]["load"] == [["Generator", "Discriminator"]]
    manifest = json.loads((ckpt / "accel_ds_fix.json").read_text())
    assert manifest["engines"] == [{"checkpoint": "pytorch_model", "models": ["generator"]},
                                   {"checkpoint": "pytorch_model_1", "models": ["discriminator"]}]
    assert (ckpt / "pytorch_model").is_dir() and (ckpt / "pytorch_model_1").is_dir()
    assert resumed["generator"] == first["generator"][2:] and resumed["discriminator"] == first["discriminator"][2:]
    assert resumed["weights"] == first["weights"]
    assert resumed["lr"] == first["lr"]
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert sorted(exported) == sorted(first["weights"]["second"])  # the model's own keys, no engine prefix
    assert exported["head.weight"].tolist() == first["weights"]["second"]["head.weight"]
    # several engines' checkpoint under another layout: refused before anything loads (no conversion for them)
    _, proc = pattern(tmp_path, "vqgan", "--deepspeed", "--zero-stage", "1", "--accumulation", "2", "--steps", "4",
                      "--resume", str(ckpt), check=False)
    assert proc.returncode != 0
    assert ("holds 2 DeepSpeed engines (one per optimizer: pytorch_model, pytorch_model_1) saved under ZeRO-2, "
            "1 process, fp32, and this run is ZeRO-1, 1 process, fp32") in proc.stderr
    assert "Nothing was loaded" in proc.stderr


def test_what_one_engine_per_optimizer_cannot_train_is_refused(tmp_path):
    said, _ = pattern(tmp_path, "refusals")
    assert "is in both optimizer 1 (AdamW, argument 2 of prepare()) and optimizer 2 (Adam" in said["shared_module"]
    assert "generator (Generator, argument 1 of prepare()) are split between optimizers" in said["split_model"]
    assert "share a submodule or parameter" in said["shared_backbone"]
    assert "ZeRO stage 1 and 2 only; the config asks for stage 3" in said["zero3"]
    assert "trains in fp16" in said["fp16"] and "Use mixed_precision bf16" in said["fp16"]
    assert all(said[f"{case}_engines_built"] == 0 for case in ("shared_module", "split_model", "zero3", "fp16"))


def test_a_loss_of_two_engines_without_accumulate_is_refused(tmp_path):
    _, proc = pattern(tmp_path, "joint", "--deepspeed", "--steps", "1", check=False)
    assert proc.returncode != 0
    assert "this loss reaches the trainable parameters of generator (engine of optimizer 1" in proc.stderr
    assert "and of discriminator (engine of optimizer 2" in proc.stderr
    assert "accelerator.accumulate(model)" in proc.stderr


def test_stale_gradients_of_another_engines_loss_are_refused(tmp_path):
    # without the discriminator's zero_grad(), plain accelerate would add the generator loss's gradients to the
    # discriminator's update; DeepSpeed cannot, so the discriminator's backward is refused
    _, proc = pattern(tmp_path, "vqgan", "--deepspeed", "--steps", "2", "--skip-discr-zero-grad", check=False)
    assert proc.returncode != 0
    assert "this loss trains discriminator (engine of optimizer 2" in proc.stderr
    assert "an earlier loss that trained generator (engine of optimizer 1" in proc.stderr
    assert "optimizer.zero_grad() before its phase" in proc.stderr
