"""Issue 18: a LoRA network trained as kohya's January 2023 train_network.py trains it (a module of its own,
patched into the UNet's and text encoder's layers, the only one in the optimizer; the UNet and text encoder
frozen after prepare()), and every merged model's state_dict() saves with safetensors 0.3.1 (that era's pin)."""

import json
import sys

import pytest

from conftest import ROOT, run
from old_releases import installed_alone

RUNS = ROOT / "tests" / "lora_network_runs.py"
OLD_SAFETENSORS = "safetensors==0.3.1"
SHARE_MEMORY = "Some tensors share memory, this will lead to duplicate memory on disk"


@pytest.fixture(scope="module")
def old_safetensors():
    return installed_alone(OLD_SAFETENSORS, ROOT / ".cache" / "safetensors-0.3.1-alone")


def lora_run(tmp_path, old_safetensors, name, *args):
    out = tmp_path / "-".join([name, *(a.strip("-") for a in args)])
    proc = run([sys.executable, RUNS, name, *args, "--out", out, "--old-safetensors", old_safetensors], warm=True)
    return json.loads((out / "result.json").read_text()), out, proc


def log_lines(proc, text):
    return [line for line in proc.stderr.splitlines() if line.startswith("LOG ") and text in line]


@pytest.mark.parametrize("stage, precision", [("2", "bf16"), ("3", "no")], ids=["zero2-bf16", "zero3"])
def test_kohya_lora_network_trains_and_saves_with_old_safetensors(tmp_path, old_safetensors, stage, precision):
    args = ("--stage", stage, "--precision", precision)
    fixed, out, proc = lora_run(tmp_path, old_safetensors, "kohya_network", *args)
    reference, reference_out, _ = lora_run(tmp_path, old_safetensors, "kohya_network", *args, "--reference")
    assert fixed["safetensors"] == "0.3.1"
    assert len(fixed["losses"]) == 4 and fixed["losses"] == reference["losses"]
    assert fixed["losses"][-1] != fixed["losses"][0]
    # 4 LoRA modules: lora_down, lora_up and the alpha buffer each; every tensor has a storage of its own.
    assert fixed["tensors"] == fixed["storages"] == 12
    if stage == "2":  # the trap without the fix: DeepSpeed's flat buffer behind every trained tensor
        assert reference["storages"] < reference["tensors"]
        assert reference["save_error"].startswith(SHARE_MEMORY)
    assert fixed["loads_back_equal"] is True
    assert fixed["tinyunet_loads_back_equal"] is fixed["tinytextencoder_loads_back_equal"] is True

    import torch
    from safetensors.torch import load_file

    saved, truth = load_file(str(out / "network.safetensors")), torch.load(reference_out / "network.truth.pt")
    assert sorted(saved) == sorted(truth)
    assert all(torch.equal(saved[k], truth[k]) for k in truth)
    assert saved["lora_unet_out.lora_up.weight"].abs().sum() > 0  # it trained: kohya starts lora_up at zero

    # The UNet and text encoder (11 tensors) frozen after prepare(): never in the optimizer, so not warned about.
    debug = log_lines(proc, "changed requires_grad after accelerator.prepare()")
    assert len(debug) == 1 and " DEBUG " in debug[0]
    assert debug[0].startswith("LOG accel_ds_fix DEBUG 11 parameter(s) changed requires_grad after accelerator.prepare() "
                               "(models.tinyunet.inp.weight, models.tinyunet.inp.bias,")
    assert debug[0].endswith("no optimizer steps them, with DeepSpeed or without, so this changes nothing")
    said = log_lines(proc, "were frozen after accelerator.prepare()")
    warnings = [line for line in said if " WARNING " in line]
    # A parameter the optimizer holds, frozen after prepare() (the run's last act): that one, and only it, is.
    assert len(warnings) == 1
    assert warnings[0].startswith("LOG accel_ds_fix WARNING 1 parameter(s) were frozen after accelerator.prepare() "
                                  "(models.loranetwork.lora_unet_out.lora_up.weight): DeepSpeed's optimizer still "
                                  "owns and steps them")


@pytest.mark.parametrize("stage", ["2", "3"])
def test_every_merged_model_saves_as_without_deepspeed(tmp_path, old_safetensors, stage):
    """The text encoder ties its output layer to its embedding: it stays tied, so old safetensors' save_file
    refuses it exactly as it refuses the model without DeepSpeed, and its save_model (made for ties) saves it."""
    result, _, _ = lora_run(tmp_path, old_safetensors, "tied_weights", "--stage", stage)
    assert result["losses"][-1] != result["losses"][0]
    merged, plain = result["merged"], result["plain"]
    assert merged["tinyunet"]["save_file_error"] is None and merged["tinyunet"]["save_file_equal"] is True
    assert merged["tinyunet"]["storages"] == merged["tinyunet"]["tensors"] == 6
    text_encoder = merged["tinytextencoder"]
    assert text_encoder["save_file_error"] == plain["tinytextencoder"]["save_file_error"]
    assert text_encoder["save_file_error"].startswith(SHARE_MEMORY) and "head.weight" in text_encoder["save_file_error"]
    assert (text_encoder["tensors"], text_encoder["storages"]) == (6, 5)  # embed.weight and head.weight: one
    for name in ("tinyunet", "tinytextencoder"):
        assert merged[name]["save_model_equal"] is merged[name]["torch_save_equal"] is True
        # torch.save writes each model's own weights, not DeepSpeed's flat buffer of both models' weights.
        for key in ("save_model_keys", "torch_save_storages", "torch_save_data_bytes"):
            assert merged[name][key] == plain[name][key], (name, key)
