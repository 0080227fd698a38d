"""A checkpoint saved under one DeepSpeed layout resumes under another (issue 20): ZeRO-2 <-> ZeRO-3, one <-> two
processes (gloo), CPU offload <-> NVMe offload <-> none, through a universal copy written beside it; another
precision is refused before anything is loaded. examples/train_two_models.py, bf16, on the CPU."""

import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from accel_ds_fix.checkpoints.layout import conversion_memory
from accel_ds_fix.errors import CheckpointError
from accel_ds_fix.memory import tiers
from conftest import EXAMPLE, clean_env, nvme_unavailable, run

# `python -m accel_ds_fix ARGS` that prints its peak resident memory last on stderr
WITH_PEAK = ("import resource, runpy, sys\nsys.argv[0] = 'accel_ds_fix'\ntry:\n"
             "    runpy.run_module('accel_ds_fix', run_name='__main__')\nfinally:\n"
             "    print('peak kB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
BF16 = ["--import-fix", "--mixed-precision", "bf16"]
LAYOUTS = {
    "zero2": ["--zero_stage", "2", "--offload_optimizer_device", "none"],
    "zero2-offload": ["--zero_stage", "2", "--offload_optimizer_device", "cpu"],
    "zero3": ["--zero_stage", "3", "--offload_optimizer_device", "none"],
    "zero3-offload": ["--zero_stage", "3", "--offload_optimizer_device", "cpu", "--offload_param_device", "cpu"],
}


def train(tmp_path, name, layout, processes, *args, check=True, nvme=None):
    """One run of the example in ``layout`` (a LAYOUTS key, or "zero3-nvme" swapping into ``nvme``) on
    ``processes`` processes; returns (losses or None, stderr)."""
    out = tmp_path / f"{name}.json"
    env = clean_env()
    if layout == "zero3-nvme":
        options = ["--zero_stage", "3", "--offload_optimizer_device", "nvme"]
        # accelerate 1.16's launcher drops --offload_optimizer_nvme_path (DeepSpeed then swaps into ./none)
        env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"] = str(nvme)
    else:
        options = LAYOUTS[layout]
    if "--offload_param_device" not in options:
        options = [*options, "--offload_param_device", "none"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", processes,
              "--num_machines", "1", "--mixed_precision", "bf16", "--gradient_accumulation_steps", "1",
              "--gradient_clipping", "1.0", *options]
    proc = run([*launch, EXAMPLE, *BF16, *args, "--out", out], env=env, check=check, timeout=900)
    return (json.loads(out.read_text())["losses"] if out.exists() else None), proc.stderr


def digests(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def said(stderr, words):
    return [line for line in stderr.splitlines() if words in line]


def test_zero2_checkpoint_resumes_under_zero3_with_its_states_and_another_precision_is_refused(tmp_path):
    """About 60 s: five trainings through `accelerate launch` (the uninterrupted one, the resume in each layout,
    the refusal), each a new process set, as a resume in another layout is."""
    ckpt = tmp_path / "ckpt"
    uninterrupted, _ = train(tmp_path, "zero2", "zero2", 1, "--steps", "8", "--save-state", ckpt,
                             "--save-state-at", "4")
    saved = json.loads((ckpt / "accel_ds_fix.json").read_text())
    layout = saved["layout"]
    assert saved["format"] == 4 and layout["deepspeed"] == importlib.metadata.version("deepspeed")
    assert {k: v for k, v in layout.items() if k != "deepspeed"} == {
        "zero_stage": 2, "world_size": 1, "offload_optimizer": "none", "offload_param": "none", "precision": "bf16"}
    before = digests(ckpt)

    # What a conversion killed half-way leaves, and a copy of an earlier checkpoint of that name: neither is taken.
    (tmp_path / ".accel_ds_fix-converting.ckpt" / "pytorch_model").mkdir(parents=True)
    (tmp_path / ".accel_ds_fix-universal.ckpt").mkdir()
    (tmp_path / ".accel_ds_fix-universal.ckpt" / "accel_ds_fix-conversion.json").write_text(
        json.dumps({"source": "0" * 64, "tag": "pytorch_model", "seconds": 1.0}))
    resumed, stderr = train(tmp_path, "zero3", "zero3", 1, "--resume", ckpt, "--first-step", "4", "--steps", "2")
    # ZeRO-3's bf16 forward rounds otherwise than ZeRO-2's (2e-5 apart from the first step of a fresh run): close,
    # not equal. A fresh start would be 0.5 away; bit-equality of the states is the round trip below.
    assert resumed == pytest.approx(uninterrupted[4:6], rel=1e-3) and resumed != uninterrupted[4:6]
    copy = tmp_path / ".accel_ds_fix-universal.ckpt"
    line = said(stderr, "converted it to DeepSpeed's universal checkpoint format in")
    assert len(line) == 1, stderr[-3000:]
    assert (f"{ckpt} was saved under ZeRO-2, 1 process, bf16; this run is ZeRO-3, 1 process, bf16: converted it to "
            "DeepSpeed's universal checkpoint format in ") in line[0]
    assert f" s into {copy} (" in line[0] and "the original unchanged) and resumed from that" in line[0]
    assert digests(ckpt) == before  # the checkpoint itself is untouched
    assert (copy / "accel_ds_fix-conversion.json").is_file()
    assert not list(tmp_path.glob(".accel_ds_fix-converting.*"))

    # Again under ZeRO-3, saving without a step: the copy is reused; that ZeRO-3 checkpoint back under ZeRO-2
    # continues bit-equal to the uninterrupted ZeRO-2 run (master weights, Adam states and step count kept).
    hop = tmp_path / "zero3-ckpt"
    _, stderr = train(tmp_path, "hop", "zero3", 1, "--resume", ckpt, "--first-step", "4", "--steps", "0",
                      "--save-state", hop)
    assert len(said(stderr, f"resumed from its universal copy {copy}, converted before")) == 1, stderr[-3000:]
    assert json.loads((hop / "accel_ds_fix.json").read_text())["layout"]["zero_stage"] == 3
    # Saved before the manifest recorded layouts (format 3): the layout is read from DeepSpeed's own files.
    manifest = json.loads((hop / "accel_ds_fix.json").read_text())
    del manifest["layout"]
    manifest["format"] = 3
    (hop / "accel_ds_fix.json").write_text(json.dumps(manifest))
    back, stderr = train(tmp_path, "back", "zero2", 1, "--resume", hop, "--first-step", "4", "--steps", "4")
    assert back == uninterrupted[4:], stderr[-3000:]
    assert said(stderr, "was saved under ZeRO-3, 1 process, bf16; this run is ZeRO-2, 1 process, bf16: converted")

    # Converted ahead of the run (for runs short of RAM): the same copy, which the run then reuses.
    made_by_load = digests(copy)
    shutil.rmtree(copy)
    proc = run([sys.executable, "-c", WITH_PEAK, "convert-checkpoint", ckpt], env=clean_env())
    assert f"converted {ckpt} to DeepSpeed's universal checkpoint format in " in proc.stdout
    assert f" s: {copy} (load_state reuses it under any ZeRO stage, number of processes and offload)" in proc.stdout
    # What the memory check reckons the conversion takes covers what it took.
    peak = int(proc.stderr.rsplit("peak kB ", 1)[1]) * 1024
    assert peak <= conversion_memory.needed(ckpt, "pytorch_model"), (peak, conversion_memory.needed(ckpt, "pytorch_model"))
    record = "accel_ds_fix-conversion.json"
    without_record = {k: v for k, v in made_by_load.items() if k != record}
    assert {k: v for k, v in digests(copy).items() if k != record} == without_record
    again = run([sys.executable, "-m", "accel_ds_fix", "convert-checkpoint", ckpt], env=clean_env())
    assert f"{copy} is already the universal copy of {ckpt}: nothing to do" in again.stdout

    # Short of host memory, in the run that resumes or on its own: stopped before converting (nothing written),
    # naming the command that converts on its own, or what else to do.
    shutil.rmtree(copy)
    need = conversion_memory.needed(ckpt, "pytorch_model")
    with pytest.raises(CheckpointError) as in_run:
        conversion_memory.check(str(ckpt), "pytorch_model", in_run=True, available=need - 1)
    assert str(in_run.value).startswith(f"accel_ds_fix: converting {ckpt} to DeepSpeed's universal checkpoint format "
                                        f"needs about {need / 2**30:.1f} GiB of host memory")
    assert (f"beside this run. Nothing was loaded; the checkpoint is unchanged. Stop the run and convert it on its own "
            f"first: `python -m accel_ds_fix convert-checkpoint {ckpt}` writes the copy") in str(in_run.value)
    with pytest.raises(CheckpointError, match=f"Nothing was written. Close what else holds memory, or convert on a "
                                              f"machine with more and copy the folder {copy} beside"):
        conversion_memory.check(str(ckpt), "pytorch_model", in_run=False, available=need - 1)
    conversion_memory.check(str(ckpt), "pytorch_model", in_run=True, available=need)
    assert not copy.exists()
    run([sys.executable, "-m", "accel_ds_fix", "convert-checkpoint", ckpt], env=clean_env())

    # A conversion killed in the middle (kill -9 of its process group): the half-made copy is never taken, and
    # the next conversion makes the same copy whole.
    shutil.rmtree(copy)
    converting = tmp_path / ".accel_ds_fix-converting.ckpt"
    child = subprocess.Popen([sys.executable, "-m", "accel_ds_fix", "convert-checkpoint", str(ckpt)], env=clean_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not any(converting.glob("*")) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    assert converting.is_dir() and not copy.exists(), "the conversion was not caught in the middle"
    proc = run([sys.executable, "-m", "accel_ds_fix", "convert-checkpoint", ckpt], env=clean_env())
    assert f"converted {ckpt} to DeepSpeed's universal checkpoint format in " in proc.stdout
    assert {k: v for k, v in digests(copy).items() if k != record} == without_record
    assert not converting.exists()

    # Another precision: refused before anything is loaded, saying what differs and what to do.
    _, stderr = train(tmp_path, "fp32", "zero2", 1, "--mixed-precision", "no", "--resume", ckpt, "--first-step", "4",
                      "--steps", "1", check=False)
    assert (f"accel_ds_fix: cannot resume from {ckpt} in this layout: it was saved under ZeRO-2, 1 process, bf16, this "
            "run is ZeRO-2, 1 process, fp32 (precision bf16 -> fp32). Layouts convert within one precision only: "
            "DeepSpeed's bf16 optimizer wrote these states (bf16's in files of their own, fp16's with its loss scale), "
            "and its fp32 optimizer does not load them. Nothing was loaded. Resume with --mixed_precision bf16, or "
            "export the weights") in stderr
    assert "step 4:" not in stderr


def test_round_trip_through_two_processes_zero3_and_nvme_keeps_every_state(tmp_path, request):
    """1 process ZeRO-2 + CPU offload -> 2 processes ZeRO-3 -> 1 process ZeRO-3 with weights and optimizer on the
    CPU (zero3-offload) -> (1 process ZeRO-3 + NVMe -> 2 processes ZeRO-3 + NVMe, where NVMe runs here) -> 2
    processes ZeRO-2 -> 1 process ZeRO-2 + CPU offload, each hop loading the previous hop's checkpoint in another
    layout and saving it again without a step: the last one continues exactly as the uninterrupted run. Width 512:
    NVMe offload swaps the sub groups out (over aio's 1 MiB).
    Over 60 s (75 s): seven hops launched through `accelerate launch`, each a new process set, as a resume in
    another layout is."""
    wide = ["--width", "512"]
    first = tmp_path / "first"
    uninterrupted, _ = train(tmp_path, "first", "zero2-offload", 1, *wide, "--steps", "7", "--save-state", first,
                             "--save-state-at", "4")
    hops = [("zero3", 2), ("zero3-offload", 1)]
    nvme = None
    if nvme_unavailable() is None:
        nvme = Path(tempfile.mkdtemp(dir=Path(tiers.DEFAULT_NVME_PATH).parent))
        request.addfinalizer(lambda: shutil.rmtree(nvme, ignore_errors=True))
        hops += [("zero3-nvme", 1), ("zero3-nvme", 2)]
    hops.append(("zero2", 2))
    previous = first
    for index, (layout, processes) in enumerate(hops):
        saved = tmp_path / f"hop{index}"
        swap = nvme / f"hop{index}" if layout == "zero3-nvme" else None
        losses, stderr = train(tmp_path, f"hop{index}", layout, processes, *wide, "--resume", previous, "--first-step",
                               "4", "--steps", "0", "--save-state", saved, nvme=swap)
        assert losses == [] and len(said(stderr, "converted it to DeepSpeed's universal checkpoint format")) == 1, \
            stderr[-3000:]
        if swap:  # it swapped (the checkpoint holds the swap files), and its clean exit left none in the folder
            assert list((saved / "pytorch_model" / "offloaded_tensors").rglob("*.tensor.swp")), f"nothing swapped"
            assert not list(swap.rglob("*.tensor.swp")), f"swap files left in {swap}"
        layout_saved = json.loads((saved / "accel_ds_fix.json").read_text())["layout"]
        assert (layout_saved["zero_stage"], layout_saved["world_size"]) == (int(layout[4]), processes)
        assert layout_saved["offload_optimizer"] == {"zero3-nvme": "nvme", "zero3-offload": "cpu"}.get(layout, "none")
        previous = saved
    back, stderr = train(tmp_path, "back", "zero2-offload", 1, *wide, "--resume", previous, "--first-step", "4",
                         "--steps", "3")
    # Bit-equal to the uninterrupted run. (DeepSpeed's own resume of `first` in its own layout is not: its third
    # loss differs by 8e-4, as the README says of CPU offload; the universal load restores the step exactly.)
    assert back == uninterrupted[4:], stderr[-3000:]
    # Loaded again in the same layout: the universal copy is reused, not converted again.
    again, stderr = train(tmp_path, "again", "zero2-offload", 1, *wide, "--resume", previous, "--first-step", "4",
                          "--steps", "1")
    assert again == uninterrupted[4:5]
    assert len(said(stderr, "resumed from its universal copy")) == 1 and not said(stderr, "converted it to")


def test_frozen_text_encoder_round_trip_zero2_zero3_zero2(tmp_path):
    # The frozen model has no optimizer states: the converter writes its weights only, the loads leave it as built.
    frozen = ["--freeze-text-encoder"]
    uninterrupted, _ = train(tmp_path, "zero2", "zero2", 1, *frozen, "--steps", "7", "--save-state", tmp_path / "ckpt",
                             "--save-state-at", "4")
    train(tmp_path, "hop", "zero3", 1, *frozen, "--resume", tmp_path / "ckpt", "--first-step", "4", "--steps", "0",
          "--save-state", tmp_path / "zero3-ckpt")
    back, stderr = train(tmp_path, "back", "zero2", 1, *frozen, "--resume", tmp_path / "zero3-ckpt", "--first-step",
                         "4", "--steps", "3")
    assert back == uninterrupted[4:], stderr[-3000:]


@pytest.mark.parametrize("args, words", [
    (["--gpu-memory", "6"], "argument --gpu-memory: '6' has no unit: write 6GiB (or 6GB, 6g; MiB, MB, m and TiB, TB, "
                            "t work too)"),
    (["--params", "0"], "argument --params: '0': a parameter count must be more than 0 (examples: 983M, 1.1B)"),
    (["--write", "/proc/nope"], "cannot write the config into /proc/nope: No such file or directory; give a folder "
                                "you can write (it is made where missing)"),
    (["--write", "FILE/configs"], "argument --write: cannot write into FILE/configs: FILE is a file, not a folder"),
    (["--params", "9" * 29], "argument --params: '" + "9" * 29 + "': more parameters than any machine trains (at "
                             "most 10000B); examples: 983M, 12B"),
    (["--params", "1" + "0" * 17], "more parameters than any machine trains"),
    (["--params", "9" * 400], "argument --params: not a parameter count: '999"),
    (["--nvme-path", "MISSING"], "argument --nvme-path: MISSING does not exist (make it first: mkdir -p MISSING): give "
                                 "the folder on the NVMe disk DeepSpeed should swap to"),
    (["--nvme-path", "/proc"], "argument --nvme-path: cannot write files in /proc (a proc filesystem): "),
    (["--host-memory", "1KB"], "argument --host-memory: '1KB' is less than the 3 GiB the plan keeps for the system "
                               "and desktop: give the whole memory, e.g. 6GiB"),
    (["--gpu-memory", "1KB"], "argument --gpu-memory: '1KB' is less than the 0.5 GiB the plan keeps for the CUDA "
                              "context and display"),
], ids=["size-without-unit", "zero-parameters", "write-into-proc", "write-under-a-file", "params-overflow",
        "params-1e17", "params-400-digits", "nvme-path-missing", "nvme-path-proc", "host-1KB", "gpu-1KB"])
def test_plan_refuses_bad_input_in_one_line(tmp_path, args, words):
    (tmp_path / "a-file").write_text("")
    a_file, missing = str(tmp_path / "a-file"), str(tmp_path / "missing" / "nvme")
    args = [a.replace("FILE", a_file).replace("MISSING", missing) for a in args]
    words = words.replace("FILE", a_file).replace("MISSING", missing)
    given = {"--params": "983M", "--gpu-memory": "6GiB", "--host-memory": "15GiB"}
    given.update(dict(zip(args[::2], args[1::2])))
    command = [sys.executable, "-m", "accel_ds_fix", "plan"]
    for key, value in given.items():
        command += [key, value]
    proc = run(command, env=clean_env(), check=False)
    assert proc.returncode == 2
    assert words in proc.stderr
    assert "Traceback" not in proc.stderr and "tier " not in proc.stdout  # no plan printed for bad input
    assert not (tmp_path / "missing").exists()  # nothing made that the user did not ask for
