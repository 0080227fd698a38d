"""DeepSpeed switched off and on at a resume (issue 41): a checkpoint that save_state wrote under DeepSpeed with
merged models resumes under plain accelerate (no DeepSpeed config), and one that plain accelerate wrote resumes
under DeepSpeed, both with their weights, Adam states and step, scheduler, random states and custom objects.
tests/on_off_runs.py (two models, one AdamW, a decaying learning rate, clip_grad_norm_ on both sides, noise from
the global random state), fp32 on the CPU, real accelerate + DeepSpeed; the reference is plain accelerate's own
uninterrupted run, whose own save_state and load_state it must match."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import clean_env, run

RUNS = Path(__file__).resolve().parent / "on_off_runs.py"
# DeepSpeed's ZeRO steps in fp32 on the CPU match plain accelerate's to 6e-8 in these losses (an fp32 rounding of
# the gradient norm's sum), CPU Adam's to about the same: far below what a lost Adam state, a wrong step count or
# learning rate, or a parameter given another's states changes (1e-3 or more at the next step).
CLOSE = 1e-6


def train(tmp_path, name, layout, *args, check=True):
    """One run of tests/on_off_runs.py; returns (its results or None, stderr)."""
    out = tmp_path / f"{name}.json"
    proc = run([sys.executable, RUNS, "--layout", layout, *args, "--out", out], env=clean_env(), check=check)
    return (json.loads(out.read_text()) if out.exists() else None), proc.stderr


def said(stderr, words):
    return [line for line in stderr.splitlines() if words in line]


def furthest(weights, reference):
    """The largest absolute difference between two runs' final weights, over every tensor of both models."""
    a, b = torch.load(weights), torch.load(reference)
    assert a.keys() == b.keys() and all(a[m].keys() == b[m].keys() for m in a)
    return max((a[m][k] - b[m][k]).abs().max().item() for m in a for k in a[m])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Plain accelerate, uninterrupted: 6 steps, its own checkpoint after step 3 (model.safetensors, model_1,
    optimizer.bin, scheduler.bin, random_states_0.pkl, custom_checkpoint_0.pkl), and its final weights."""
    folder = tmp_path_factory.mktemp("plain")
    results, _ = train(folder, "plain", "none", "--steps", "6", "--save", folder / "ckpt", "--save-at", "3",
                       "--weights", folder / "weights.pt")
    assert {p.name for p in (folder / "ckpt").iterdir()} >= {"model.safetensors", "model_1.safetensors",
                                                             "optimizer.bin", "scheduler.bin"}
    # plain accelerate resumes its own checkpoint exactly: the standard the conversions are held to
    resumed, _ = train(folder, "own", "none", "--resume", folder / "ckpt", "--first-step", "3", "--steps", "3")
    assert resumed["losses"] == results["losses"][3:] and resumed["count"] == 6
    return folder, results


@pytest.mark.parametrize("saved_under, resumed_under", [("zero2", "zero3"), ("zero3-offload", "zero2"),
                                                        ("zero1", "zero2-offload")])
def test_deepspeed_checkpoint_resumes_without_deepspeed_and_back(tmp_path, plain, saved_under, resumed_under):
    """About 11 s: a DeepSpeed run saves after step 3, plain accelerate resumes it for steps 4 to 6 and saves after
    step 4, and DeepSpeed in another layout resumes that for steps 5 and 6; each leg continues as the uninterrupted
    plain run."""
    reference_dir, reference = plain
    ckpt = tmp_path / "ds-ckpt"
    first, _ = train(tmp_path, "ds", saved_under, "--steps", "3", "--save", ckpt, "--save-at", "3")
    assert first["losses"] == pytest.approx(reference["losses"][:3], abs=CLOSE)
    assert (ckpt / "pytorch_model").is_dir() and not (ckpt / "model.safetensors").exists()

    # DeepSpeed off: accelerate alone ends in FileNotFoundError (model.safetensors / pytorch_model.bin) here
    home = tmp_path / "plain-ckpt"
    resumed, stderr = train(tmp_path, "off", "none", "--resume", ckpt, "--first-step", "3", "--steps", "3", "--save",
                            home, "--save-at", "4", "--weights", tmp_path / "weights.pt")
    assert resumed["lrs"] == reference["lrs"][3:] and resumed["count"] == 6  # the scheduler, the custom object
    assert max(abs(a - b) for a, b in zip(resumed["losses"], reference["losses"][3:])) < CLOSE, resumed
    assert furthest(tmp_path / "weights.pt", reference_dir / "weights.pt") < CLOSE
    line = said(stderr, "this run has no DeepSpeed: converted it for plain accelerate")
    assert len(line) == 1, stderr[-3000:]
    assert line[0].startswith(f"accel_ds_fix: {ckpt} was saved under DeepSpeed (ZeRO-{saved_under[4]}, 1 process")
    assert ("(tinyunet, tinytextencoder: the weights, AdamW's exp_avg, exp_avg_sq and step at step 3, the scheduler, "
            f"the random states) through its universal copy {tmp_path / '.accel_ds_fix-universal.ds-ckpt'} "
            "(made now, the original unchanged)") in line[0]

    # DeepSpeed on again, in another layout, from plain accelerate's own checkpoint of step 4
    back, stderr = train(tmp_path, "on", resumed_under, "--resume", home, "--first-step", "4", "--steps", "2")
    assert back["lrs"] == reference["lrs"][4:] and back["count"] == 6
    assert max(abs(a - b) for a, b in zip(back["losses"], reference["losses"][4:])) < CLOSE, back
    line = said(stderr, f"{home} was saved by plain accelerate; this run is ZeRO-{resumed_under[4]}, 1 process")
    assert len(line) == 1, stderr[-3000:]
    engine_optimizer = "DeepSpeedCPUAdam" if "offload" in resumed_under else "AdamW"  # offload's own optimizer
    assert (f"converted it (tinyunet, tinytextencoder: the weights, {engine_optimizer} given optimizer.bin's exp_avg, exp_avg_sq "
            "and step 4, the scheduler, the random states) through DeepSpeed's universal checkpoint format in "
            f"{tmp_path / '.accel_ds_fix-universal.plain-ckpt'} (made now, the original unchanged)") in line[0]
    assert not list(tmp_path.glob(".accel_ds_fix-converting.*"))


def test_plain_checkpoint_under_deepspeed_exact_leftovers_of_a_killed_conversion_and_refusals(tmp_path, plain):
    """About 20 s. Plain accelerate's checkpoint of step 3 under ZeRO-2: steps 4 to 6 as the uninterrupted plain
    run; what a conversion killed half-way leaves is never taken; another optimizer is refused before anything
    is loaded, on both sides."""
    reference_dir, reference = plain
    ckpt = reference_dir / "ckpt"
    copy = reference_dir / ".accel_ds_fix-universal.ckpt"
    # What a kill -9 in the middle of a conversion leaves (the temporary folder), and a copy of other content (a
    # checkpoint that was overwritten since): neither is taken; the original is never changed.
    (reference_dir / ".accel_ds_fix-converting.ckpt" / "pytorch_model" / "zero").mkdir(parents=True)
    copy.mkdir(exist_ok=True)
    (copy / "accel_ds_fix-conversion.json").write_text(json.dumps({"source": "0" * 64, "tag": "pytorch_model"}))
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    resumed, stderr = train(tmp_path, "on", "zero2", "--resume", ckpt, "--first-step", "3", "--steps", "3",
                            "--weights", tmp_path / "weights.pt")
    assert resumed["lrs"] == reference["lrs"][3:] and resumed["count"] == 6
    assert max(abs(a - b) for a, b in zip(resumed["losses"], reference["losses"][3:])) < CLOSE, resumed
    assert furthest(tmp_path / "weights.pt", reference_dir / "weights.pt") < CLOSE
    assert len(said(stderr, f"format in {copy} (made now, the original unchanged)")) == 1, stderr[-3000:]
    assert not (reference_dir / ".accel_ds_fix-converting.ckpt").exists()
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    # loaded again: the copy is reused
    again, stderr = train(tmp_path, "again", "zero2", "--resume", ckpt, "--first-step", "3", "--steps", "1")
    assert again["losses"] == resumed["losses"][:1]
    assert len(said(stderr, f"format in {copy} (made before, the original unchanged)")) == 1, stderr[-3000:]

    # Another optimizer than Adam: refused, naming it, before any step or load.
    _, stderr = train(tmp_path, "sgd-on", "zero2", "--sgd", "--resume", ckpt, "--first-step", "3", "--steps", "1",
                      check=False)
    assert (f"accel_ds_fix: cannot load {ckpt} under DeepSpeed: this run's DeepSpeed engine steps another optimizer "
            "than Adam (its optimizer is torch.optim.sgd.SGD, whose states are not Adam's). Nothing was loaded. Use "
            "torch.optim.AdamW (or Adam) as the run that saved it did.") in stderr, stderr[-3000:]
    ds_ckpt = tmp_path / "ds-ckpt"
    train(tmp_path, "ds", "zero2", "--steps", "1", "--save", ds_ckpt, "--save-at", "1")
    _, stderr = train(tmp_path, "sgd-off", "none", "--sgd", "--resume", ds_ckpt, "--first-step", "1", "--steps", "1",
                      check=False)
    assert (f"accel_ds_fix: cannot load {ds_ckpt} without DeepSpeed: the checkpoint holds Adam's states (exp_avg, "
            "exp_avg_sq, step) and its optimizer is torch.optim.sgd.SGD, whose states are not Adam's. Nothing was "
            "loaded.") in stderr, stderr[-3000:]
    assert not (tmp_path / ".accel_ds_fix-universal.ds-ckpt").exists()  # refused before converting


WIDE = ["--width", "3072"]  # 9.5M parameters a model: each conversion takes about 2 s on 2 cores, long enough to kill


def killed_while_converting(tmp_path, name, converting, layout, *args):
    """tests/on_off_runs.py started, and SIGKILLed once its conversion has written its third parameter folder (in
    ``converting``, or wherever it writes: the universal copy's own name); returns what ``converting`` held then."""
    copy = converting.parent / converting.name.replace(".accel_ds_fix-converting.", ".accel_ds_fix-universal.")
    zeros = [folder / "pytorch_model" / "zero" for folder in (converting, copy)]
    proc = subprocess.Popen([sys.executable, RUNS, "--layout", layout, *args, "--out", tmp_path / f"{name}.json"],
                            env=clean_env(), cwd=RUNS.parent.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if any(zero.is_dir() and len(list(zero.iterdir())) >= 3 for zero in zeros):
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
    finally:
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        stderr = proc.communicate()[1].decode()
    assert proc.returncode == -signal.SIGKILL, f"the conversion ended before the kill ({proc.returncode}): {stderr[-3000:]}"
    return sorted(p.relative_to(converting).as_posix() for p in converting.rglob("*"))


def test_a_conversion_killed_half_way_is_made_again_in_both_directions(tmp_path):
    """About 35 s. kill -9 of a real conversion (wide models), DeepSpeed -> plain (the universal copy being made) and
    plain -> DeepSpeed (the converting folder being written): what it left is not taken, the next load_state makes
    the copy anew and continues as the uninterrupted runs."""
    ckpt, home = tmp_path / "ds-ckpt", tmp_path / "plain-ckpt"
    ds, _ = train(tmp_path, "ds", "zero2", *WIDE, "--steps", "6", "--save", ckpt, "--save-at", "3")
    for checkpoint, layout, args in ((ckpt, "none", ["--first-step", "3", "--steps", "3", "--save", home,
                                                     "--save-at", "4"]),
                                     (home, "zero2", ["--first-step", "4", "--steps", "2"])):
        converting = tmp_path / f".accel_ds_fix-converting.{checkpoint.name}"
        copy = tmp_path / f".accel_ds_fix-universal.{checkpoint.name}"
        before = {p.relative_to(checkpoint).as_posix(): p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()}
        left = killed_while_converting(tmp_path, f"killed-{layout}", converting, layout, *WIDE, "--resume",
                                       checkpoint, *args)
        # half-done: some parameters' folders, no record; nothing under the copy's name; the checkpoint unchanged
        assert not copy.exists(), sorted(copy.rglob("*"))  # nothing under the name of a whole copy
        assert any(p.startswith("pytorch_model/zero/models.") for p in left), left
        assert "accel_ds_fix-conversion.json" not in left, left
        assert not home.exists() or checkpoint == home  # the killed plain run saved nothing
        resumed, stderr = train(tmp_path, f"resumed-{layout}", layout, *WIDE, "--resume", checkpoint, *args)
        assert len(said(stderr, f"{copy} (made now, the original unchanged)")) == 1, stderr[-3000:]
        assert not converting.exists() and (copy / "accel_ds_fix-conversion.json").is_file()
        assert {p.relative_to(checkpoint).as_posix(): p.read_bytes() for p in checkpoint.rglob("*")
                if p.is_file()} == before
        copied = {p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()}
        assert not any(p.startswith("pytorch_model/tmp") for p in copied)  # the converter's scratch: gone
        assert len({p for p in copied if p.endswith("/fp32.pt")}) == 11  # every parameter of both models
        if layout == "none":
            off = resumed
            # the master weights exactly (the first loss comes from them alone), the Adam states after
            assert off["losses"][0] == ds["losses"][3] and off["lrs"] == ds["lrs"][3:] and off["count"] == 6
            assert max(abs(a - b) for a, b in zip(off["losses"], ds["losses"][3:])) < CLOSE, (off, ds)
        else:
            assert resumed["lrs"] == off["lrs"][1:] and resumed["count"] == 6
            assert max(abs(a - b) for a, b in zip(resumed["losses"], off["losses"][1:])) < CLOSE, (resumed, off)

    # What a kill of plain accelerate's own save between its model files leaves (model.safetensors, no
    # model_1.safetensors): refused, as plain accelerate's own load fails there; before, the text encoder kept the
    # weights it was built with, "loaded by the script's load hook" where the script has none.
    cut = tmp_path / "cut-ckpt"
    shutil.copytree(home, cut)
    (cut / "model_1.safetensors").unlink()
    _, stderr = train(tmp_path, "cut", "zero2", *WIDE, "--resume", cut, "--first-step", "4", "--steps", "1",
                      check=False)
    assert (f"accel_ds_fix: cannot load {cut} under DeepSpeed: it holds no weights file for tinytextencoder "
            "(model_1.safetensors or pytorch_model_1.bin) and this run registered no load hook to load it") in stderr, \
        stderr[-3000:]
    assert not (tmp_path / ".accel_ds_fix-universal.cut-ckpt").exists()


def test_bf16_plain_to_deepspeed_and_back_is_bit_exact(tmp_path):
    """About 12 s. bf16 on both sides (plain accelerate: fp32 weights under bf16 autocast; DeepSpeed: bf16 weights,
    fp32 master weights and Adam states): plain accelerate's checkpoint of step 3, loaded under ZeRO-2 bf16 and saved
    there unchanged, then resumed by plain accelerate, continues bit for bit as plain's uninterrupted run (both
    conversions keep fp32 exactly). Each side's own steps differ by up to 4e-3 in these losses (the forward rounds
    otherwise), so a run through DeepSpeed's steps is only close."""
    ckpt, hop = tmp_path / "plain-ckpt", tmp_path / "ds-ckpt"
    plain, _ = train(tmp_path, "plain", "none", "--precision", "bf16", "--steps", "6", "--save", ckpt, "--save-at",
                     "3", "--weights", tmp_path / "plain.pt")
    _, stderr = train(tmp_path, "hop", "zero2", "--precision", "bf16", "--resume", ckpt, "--first-step", "3",
                      "--steps", "0", "--save", hop, "--save-at", "3")
    assert len(said(stderr, "this run is ZeRO-2, 1 process, bf16: converted it")) == 1, stderr[-3000:]
    assert json.loads((hop / "accel_ds_fix.json").read_text())["layout"]["precision"] == "bf16"
    back, stderr = train(tmp_path, "back", "none", "--precision", "bf16", "--resume", hop, "--first-step", "3",
                         "--steps", "3", "--weights", tmp_path / "back.pt")
    assert len(said(stderr, "(ZeRO-2, 1 process, bf16); this run has no DeepSpeed: converted it for plain accelerate "
                            "(tinyunet, tinytextencoder: the fp32 master weights of what trains,")) == 1, stderr[-3000:]
    assert back["losses"] == plain["losses"][3:] and back["lrs"] == plain["lrs"][3:] and back["count"] == 6
    assert furthest(tmp_path / "back.pt", tmp_path / "plain.pt") == 0


def test_two_process_zero2_checkpoint_resumed_by_one_plain_process_and_back_under_two_process_zero3(tmp_path):
    """About 35 s. `accelerate launch --num_processes 2` (gloo) on the CPU: a 2-process ZeRO-2 checkpoint (two
    optimizer shards) resumed by one plain process continues as the 2-process run, clipped and unclipped; plain
    accelerate's checkpoint of that resumed under 2-process ZeRO-3 continues as plain accelerate. Every process
    trains on the same batches and noise of the step (--step-noise: the plain checkpoint holds random_states_0.pkl
    alone)."""
    ckpt, home = tmp_path / "ds-ckpt", tmp_path / "plain-ckpt"

    def launched(name, stage, *args, clip="1.0"):
        out = tmp_path / f"{name}.json"
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--zero_stage", stage, "--offload_optimizer_device",
                  "none", "--offload_param_device", "none", "--gradient_accumulation_steps", "1",
                  "--gradient_clipping", clip]
        proc = run([*launch, RUNS, "--layout", f"zero{stage}", "--step-noise", "--clip", clip, *args, "--out", out],
                   env=clean_env())
        return json.loads(out.read_text()), proc.stderr

    ds, _ = launched("ds", "2", "--steps", "6", "--save", ckpt, "--save-at", "3")
    assert ds["processes"] == 2 and len(list((ckpt / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt"))) == 2
    off, stderr = train(tmp_path, "off", "none", "--step-noise", "--resume", ckpt, "--first-step", "3", "--steps", "3",
                        "--save", home, "--save-at", "4")
    assert len(said(stderr, f"{ckpt} was saved under DeepSpeed (ZeRO-2, 2 processes, fp32); this run has no "
                            "DeepSpeed: converted it")) == 1, stderr[-3000:]
    assert off["losses"][0] == ds["losses"][3] and off["lrs"] == ds["lrs"][3:] and off["count"] == 6  # the weights
    # then each step clips: DeepSpeed sums the two processes' partial norms, plain accelerate the tensors' own, so
    # the factor may differ in its last bit (3e-8 in the third loss on a CPU with AVX-512)
    assert max(abs(a - b) for a, b in zip(off["losses"], ds["losses"][3:])) < CLOSE, (off, ds)
    # unclipped, nothing is summed in another order: the plain process continues bit for bit
    unclipped = tmp_path / "ds-ckpt-unclipped"
    ds_bare, _ = launched("ds-unclipped", "2", "--steps", "6", "--save", unclipped, "--save-at", "3", clip="0")
    off_bare, _ = train(tmp_path, "off-unclipped", "none", "--step-noise", "--clip", "0", "--resume", unclipped,
                        "--first-step", "3", "--steps", "3")
    assert off_bare["losses"] == ds_bare["losses"][3:] and off_bare["losses"] != off["losses"]
    back, stderr = launched("back", "3", "--resume", home, "--first-step", "4", "--steps", "2")
    assert len(said(stderr, f"{home} was saved by plain accelerate; this run is ZeRO-3, 2 processes, fp32: "
                            "converted it")) == 1, stderr[-3000:]
    assert back["processes"] == 2 and back["lrs"] == off["lrs"][1:] and back["count"] == 6
    assert max(abs(a - b) for a, b in zip(back["losses"], off["losses"][1:])) < CLOSE, (back, off)
