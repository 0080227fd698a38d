"""Checkpoints that survive a crash (issue 19): a save_state killed at any point never costs the previous
checkpoint, and load_state never takes a half-written one.

A real save is killed (SIGKILL, as kill -9, an OOM kill or a power cut do) in a child process at each file it
writes and between files (tests/crash_save_child.py holds the trigger), under ZeRO-2 with CPU offload and under
ZeRO-3. Each run after a kill loads the folder and trains on: its losses must equal, bit for bit, those of
resuming the first checkpoint, or the load must be refused with the package's error. Runs are chained: the
run that checks the previous kill is the one whose own save is killed next.
"""

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import EXAMPLE, clean_env, run, skip_without_nvme

CHILD = Path(__file__).resolve().parent / "crash_save_child.py"
PATTERNS = Path(__file__).resolve().parent / "hook_patterns.py"
STAGES = {"zero2-offload": ["--zero-stage", "2", "--offload", "cpu"], "zero3": ["--zero-stage", "3"]}
SAVED = ["pytorch_model/mp_rank_00_model_states.pt", "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
         "zero_to_fp32.py", "zero_to_torch.py", "latest", "scheduler.bin", "random_states_0.pkl", "accel_ds_fix.json"]
REFUSED = "CheckpointError: accel_ds_fix: refusing to load "


def child(fault, folder, script, *args, check=False):
    env = clean_env(ACCEL_DS_FIX_TEST_FAULT=fault, ACCEL_DS_FIX_TEST_FAULT_DIR=str(folder))
    return run([sys.executable, CHILD, script, *args], env=env, check=check, warm=True)


def resume_and_save(stage, folder, losses_file):
    """Resume ``folder``, train 2 steps, write the losses, then save_state into ``folder`` again (kohya's
    in-place ``last-state``)."""
    return [*stage, "--import-fix", "--resume", folder, "--first-step", "3", "--steps", "2",
            "--losses-before-save", losses_file, "--save-state", folder]


def first_checkpoint(train, tmp_path, stage):
    """The previous checkpoint (3 steps), and what resuming it gives: its losses and the files a save writes
    (counted in a copy that is saved again in place)."""
    ckpt, copy = tmp_path / "ckpt", tmp_path / "copy"
    train(*stage, "--import-fix", "--steps", "3", "--save-state", ckpt)
    shutil.copytree(ckpt, copy)
    child(f"count:{tmp_path / 'files.txt'}", copy, EXAMPLE, *resume_and_save(stage, copy, tmp_path / "ref.json"),
          check=True)
    expected = json.loads((tmp_path / "ref.json").read_text())["losses"]
    files = (tmp_path / "files.txt").read_text().split()
    saved = json.loads((copy / "accel_ds_fix.json").read_text())
    assert sorted(saved["files"]) == sorted(f for f in files if f != "accel_ds_fix.json")
    assert not list(tmp_path.glob(".accel_ds_fix-*"))  # the in-place save left nothing beside it
    return ckpt, expected, files


def kill_chain(tmp_path, stage, ckpt, expected, points):
    """Each point's run resumes what the previous point left; returns {point: outcome of the run it hit}."""
    outcomes = {}
    for number, point in enumerate(points):
        losses = tmp_path / f"losses{number}.json"
        proc = child(point, ckpt, EXAMPLE, *resume_and_save(stage, ckpt, losses))
        assert json.loads(losses.read_text())["losses"] == expected, (point, "resumed other losses")
        outcomes[point] = proc
        if point.startswith(("torn", "closed", "rename")):
            assert proc.returncode == -9, (point, proc.returncode, proc.stderr[-3000:])
        assert not (ckpt.parent / ".accel_ds_fix-old.ckpt").exists() or point.startswith("rename"), point
    return outcomes


def test_killed_saves_zero2_offload_resume_the_previous_checkpoint_or_are_refused(train, tmp_path):
    """About 30 s (it took 183 s before the warm start): one training killed at each of the save's points
    (before, inside and between its files, in the manifest, between the renames), each followed by a resume in a
    new process; a kill is what is tested, so each needs a process of its own (forked warm: tests/warm_start.py)."""
    stage = STAGES["zero2-offload"]
    ckpt, expected, files = first_checkpoint(train, tmp_path, stage)
    # the 4 files of the issue, DeepSpeed's scripts and latest, and the manifest last
    assert files == SAVED
    # Killed between every two files (and before the first, after the last), in the middle of the model states
    # and of the manifest (a torn file elsewhere is the same case: the save's folder is not whole), Ctrl-C, a
    # full disk, and between the two renames that put the new folder in place.
    points = ([f"closed:{i}" for i in range(len(files) + 1)] + ["torn:1", "torn:8"]
              + ["interrupt:2", "enospc:6", "rename:1"])
    outcomes = kill_chain(tmp_path, stage, ckpt, expected, points)
    interrupted = outcomes["interrupt:2"]
    assert interrupted.returncode != 0
    assert (f"KeyboardInterrupt: accel_ds_fix: save_state({ckpt}) was interrupted (Ctrl-C) before it finished: "
            f"nothing of it was kept; the previous checkpoint at {ckpt} is untouched.") in interrupted.stderr
    full = outcomes["enospc:6"]
    assert full.returncode != 0
    assert (f"CheckpointError: accel_ds_fix: save_state({ckpt}) ran out of disk space (the disk is full) after "
            "writing" in full.stderr)
    assert "it needs about " in full.stderr and " free when it started. Nothing of it was kept; the previous " \
        f"checkpoint at {ckpt} is untouched. Free some space or save elsewhere." in full.stderr
    # rename:1 killed the save between moving the old folder away and the new one in. Its new folder was whole (its
    # manifest written, every file flushed): the next load_state puts it in place and resumes it, with no other save.
    # Either folder the cut swap left, passed to load_state, is refused with the target that resumes named.
    for leftover in (tmp_path / ".accel_ds_fix-partial.ckpt", tmp_path / ".accel_ds_fix-old.ckpt"):
        refused = resume_from(stage, leftover, 5, tmp_path / "refused.json", check=False)
        assert (f"{REFUSED}{leftover}: it is the temporary folder of a save_state into {ckpt} that did not finish "
                f"(killed or interrupted), not a checkpoint. Nothing was loaded. load_state({ckpt}) resumes the "
                "checkpoint that save wrote: its files are whole (checked against its manifest), and the load puts "
                "it in place first.") in refused.stderr, refused.stderr[-3000:]
    recovered = resume_from(stage, ckpt, 5, tmp_path / "recovered.json")
    assert (f"put the checkpoint that a save_state cut off at its end had written in place at {ckpt} (its files are "
            "whole: checked against its manifest)") in recovered.stderr
    assert json.loads((tmp_path / "recovered.json").read_text())["losses"] == after_save(stage, tmp_path)
    assert not list(tmp_path.glob(".accel_ds_fix-*"))


def resume_from(stage, ckpt, step, out, check=True):
    return run([sys.executable, EXAMPLE, *stage, "--import-fix", "--resume", ckpt, "--first-step", str(step),
                "--steps", "2", "--out", out], check=check, warm=True)


def after_save(stage, tmp_path):
    """Steps 5 - 6 from the checkpoint a finished resume_and_save wrote (first_checkpoint's copy, saved after step
    4): what a save cut off after it had written everything must give."""
    reference = tmp_path / "after-save.json"
    if not reference.exists():
        resume_from(stage, tmp_path / "copy", 5, reference)
    return json.loads(reference.read_text())["losses"]


@pytest.mark.parametrize("point", ["sigint-rename:1", "sigint-rename:2"])
def test_ctrl_c_at_the_end_of_a_save_keeps_the_new_checkpoint_and_says_so(train, tmp_path, point):
    """Ctrl-C between the two renames that put the new folder in place, and right after them: the swap finishes,
    the message says the new checkpoint is in place, and it resumes exactly, with nothing left beside it."""
    stage = STAGES["zero2-offload"]
    ckpt, _, _ = first_checkpoint(train, tmp_path, stage)
    proc = child(point, ckpt, EXAMPLE, *resume_and_save(stage, ckpt, tmp_path / "losses.json"))
    assert proc.returncode != 0
    assert (f"KeyboardInterrupt: accel_ds_fix: save_state({ckpt}) was interrupted (Ctrl-C) as it finished: the new "
            f"checkpoint is in place at {ckpt} and whole (its manifest lists every file).") in proc.stderr
    assert "nothing of it was kept" not in proc.stderr
    assert not list(tmp_path.glob(".accel_ds_fix-*"))
    resume_from(stage, ckpt, 5, tmp_path / "resumed.json")
    assert json.loads((tmp_path / "resumed.json").read_text())["losses"] == after_save(stage, tmp_path)


def test_a_killed_saves_leftover_folder_is_named_as_such_when_loaded(train, tmp_path):
    stage = STAGES["zero2-offload"]
    ckpt, expected, _ = first_checkpoint(train, tmp_path, stage)
    shutil.rmtree(tmp_path / "copy")  # a newer whole checkpoint beside it, which the message would name instead
    killed = child("torn:1", ckpt, EXAMPLE, *resume_and_save(stage, ckpt, tmp_path / "losses.json"))
    assert killed.returncode == -9
    partial = tmp_path / ".accel_ds_fix-partial.ckpt"
    proc = resume_from(stage, partial, 3, tmp_path / "x.json", check=False)
    assert proc.returncode != 0
    assert (f"{REFUSED}{partial}: it is the temporary folder of a save_state into {ckpt} that did not finish (killed "
            f"or interrupted), not a checkpoint. Nothing was loaded. The newest whole checkpoint beside it is "
            f"{ckpt}.") in proc.stderr
    resume_from(stage, ckpt, 3, tmp_path / "resumed.json")  # and the checkpoint itself was never touched
    assert json.loads((tmp_path / "resumed.json").read_text())["losses"] == expected


def test_killed_saves_zero3_resume_the_previous_checkpoint(train, tmp_path):
    """A few points under ZeRO-3 (every one between files under ZeRO-2 above): before the first file, in the
    optimizer states, in the manifest."""
    stage = STAGES["zero3"]
    points = ["closed:0", "torn:2", "torn:8"]
    ckpt, expected, files = first_checkpoint(train, tmp_path, stage)
    assert files == ["pytorch_model/zero_pp_rank_0_mp_rank_00_model_states.pt", *SAVED[1:]]
    kill_chain(tmp_path, stage, ckpt, expected, points)
    run([sys.executable, EXAMPLE, *stage, "--import-fix", "--resume", ckpt, "--first-step", "3", "--steps", "2",
         "--out", tmp_path / "last.json"], warm=True)
    assert json.loads((tmp_path / "last.json").read_text())["losses"] == expected


def test_altered_missing_and_extra_files_are_refused(train, tmp_path):
    stage = STAGES["zero2-offload"]
    ckpt = tmp_path / "ckpt"
    train(*stage, "--import-fix", "--steps", "3", "--save-state", ckpt)
    shutil.copytree(ckpt, tmp_path / "whole")
    states = ckpt / "pytorch_model" / "mp_rank_00_model_states.pt"
    data = bytearray(states.read_bytes())
    data[len(data) // 2] ^= 0xFF
    states.write_bytes(bytes(data))
    (ckpt / "random_states_0.pkl").unlink()
    (ckpt / "notes.txt").write_text("x")
    proc = run([sys.executable, EXAMPLE, *stage, "--import-fix", "--resume", ckpt, "--first-step", "3",
                "--steps", "2"], check=False, warm=True)
    assert proc.returncode != 0
    assert (f"{REFUSED}{ckpt}: it is not the checkpoint save_state wrote there (partial, mixed or altered): missing "
            "random_states_0.pkl; not written by the save: notes.txt; pytorch_model/mp_rank_00_model_states.pt has "
            "other contents than the save wrote (sha256 differs). Nothing was loaded. The newest whole checkpoint "
            f"beside it is {tmp_path / 'whole'}.") in proc.stderr
    assert "step 3: loss" not in proc.stdout


def test_diffusers_hook_files_are_part_of_the_checkpoint_and_a_kill_in_them_costs_nothing(tmp_path):
    """diffusers' save hook writes each model with save_pretrained into a subfolder of the folder it is given;
    killed while the hook writes, the previous checkpoint resumes exactly."""
    ckpt = tmp_path / "ckpt"
    first = tmp_path / "first.json"
    run([sys.executable, PATTERNS, "diffusers", "--zero-stage", "2", "--steps", "6", "--save-at", "3",
         "--checkpoint", ckpt, "--out", first], warm=True)
    listed = json.loads((ckpt / "accel_ds_fix.json").read_text())["files"]
    assert "unet/weights.pt" in listed and "text_encoder/model.safetensors" in listed
    killed = child("torn:unet/weights.pt", ckpt, PATTERNS, "diffusers", "--zero-stage", "2", "--steps", "4",
                   "--save-at", "4", "--checkpoint", ckpt, "--out", tmp_path / "killed.json")
    assert killed.returncode == -9
    resumed = tmp_path / "resumed.json"
    run([sys.executable, PATTERNS, "diffusers", "--zero-stage", "2", "--steps", "3", "--resume", ckpt,
         "--out", resumed], warm=True)
    assert json.loads(resumed.read_text())["losses"] == json.loads(first.read_text())["losses"][3:]


def test_automatic_checkpoint_naming_with_total_limit(tmp_path):
    proc = run([sys.executable, Path(__file__).resolve().parent / "automatic_naming_child.py", tmp_path / "project"],
               warm=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["saved"] == ["checkpoint_1", "checkpoint_2"]  # total_limit=2: checkpoint_0 deleted, as accelerate does
    assert out["manifests"] == [True, True]
    assert out["resumed_newest"] is True and len(out["losses"]) == 4  # checkpoint_2, not the killed save's folder


@pytest.mark.parametrize("tier", ["zero3-offload", "zero3-nvme"])
def test_killed_saves_of_the_other_shipped_tiers_resume_the_previous_checkpoint(train, tmp_path, request, tier):
    """The shipped tiers' layouts beyond ZeRO-2 + CPU offload: ZeRO-3 with weights and optimizer on the CPU, and with
    the optimizer on NVMe (its checkpoint holds the swapped optimizer states): killed before the first file, inside
    the optimizer states and between two files. Up to 73 s (zero3-nvme): each kill is a launched run and a resume."""
    stage = ["--zero-stage", "3", "--offload", "cpu", "--offload-params"]
    if tier == "zero3-nvme":
        skip_without_nvme()
        from accel_ds_fix.memory import tiers

        swap = Path(tempfile.mkdtemp(dir=Path(tiers.DEFAULT_NVME_PATH).parent))  # a disk, not a tmpfs /tmp
        request.addfinalizer(lambda: shutil.rmtree(swap, ignore_errors=True))
        stage = ["--zero-stage", "3", "--offload", "nvme", "--nvme-path", str(swap)]
    ckpt, expected, files = first_checkpoint(train, tmp_path, stage)
    states = next(i for i, f in enumerate(files, 1) if "optim_states" in f)  # the child counts files from 1
    kill_chain(tmp_path, stage, ckpt, expected, ["closed:0", f"torn:{states}", f"closed:{states}"])
    run([sys.executable, EXAMPLE, *stage, "--import-fix", "--resume", ckpt, "--first-step", "3", "--steps", "2",
         "--out", tmp_path / "last.json"], warm=True)
    assert json.loads((tmp_path / "last.json").read_text())["losses"] == expected


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of 4 MiB (a tmpfs), to fill: mounting needs root (CI has it)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here ({proc.stderr.strip() or 'mount failed'}): needs root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.parametrize("point", ["fill:1", "fill:5", "fill:6"],
                         ids=["in-torch-save", "in-a-python-write", "at-the-end-of-torch-save"])
def test_a_full_disk_mid_save_is_said_and_the_previous_checkpoint_resumes(train, tmp_path, small_disk, point):
    """The disk fills while a save writes (fill:N fills it with a file as the N-th file of the save opens): DeepSpeed's
    torch.save then fails with "unexpected pos" or "iostream error" (no errno), a Python write with ENOSPC. Each way
    the user reads that the disk is full, how much the save needs, and that the previous checkpoint is untouched;
    it resumes exactly."""
    stage = STAGES["zero2-offload"]
    ckpt = small_disk / "ckpt"
    reference = train(*stage, "--import-fix", "--steps", "5", "--save-state", ckpt, "--save-state-at", "3")
    proc = child(point, ckpt, EXAMPLE, *resume_and_save(stage, ckpt, tmp_path / "losses.json"))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert (f"accel_ds_fix.errors.CheckpointError: accel_ds_fix: save_state({ckpt}) ran out of disk space (the disk "
            "is full) after writing ") in last, proc.stderr[-3000:]
    assert re.search(r"it needs about \d+\.\d KiB and the disk of \S+ had \d+\.\d (KiB|MiB) free when it started\. "
                     rf"Nothing of it was kept; the previous checkpoint at {ckpt} is untouched\.", last), last
    assert not list(small_disk.glob(".accel_ds_fix-*"))  # the cut-off save's folder is gone
    (small_disk / "filler").unlink()
    resume_from(stage, ckpt, 3, tmp_path / "resumed.json")
    assert json.loads((tmp_path / "resumed.json").read_text())["losses"] == reference["losses"][3:5]


def test_a_first_save_on_a_full_disk_says_what_it_needs(tmp_path, small_disk):
    """No earlier checkpoint to size it by: the message sizes the save from the models (weights and 12 bytes a
    trained parameter)."""
    ckpt = small_disk / "runs" / "ckpt"  # and a parent folder that does not exist yet, as scripts save
    proc = child("fill:1", ckpt, EXAMPLE, *STAGES["zero2-offload"], "--import-fix", "--steps", "2", "--save-state",
                 ckpt)
    assert proc.returncode != 0
    assert re.search(rf"save_state\({ckpt}\) ran out of disk space \(the disk is full\) after writing [\d.]+ KiB: it "
                     r"needs about [\d.]+ KiB and the disk of \S+ had [\d.]+ (KiB|MiB) free when it started\. Nothing "
                     r"of it was kept\. Free some space", proc.stderr), proc.stderr[-3000:]


def _saved_bytes(folder):
    return sum(f["size"] for f in json.loads((folder / "accel_ds_fix.json").read_text())["files"].values())


def test_another_runs_checkpoint_beside_the_target_does_not_size_the_save(train, tmp_path, small_disk):
    """Issue 41, item 6: a save into a folder that does not exist yet (as scripts save), beside another run's larger
    checkpoint that leaves room for this save but not for its own size, is written and resumes; a disk that fills
    mid-save names this run's size, not the neighbour's; a disk without room for this run's weights and optimizer
    states refuses the save before anything is written."""
    stage = STAGES["zero2-offload"]
    large = small_disk / "out" / "large"
    train(*stage, "--import-fix", "--width", "256", "--steps", "1", "--save-state", large)
    neighbour = _saved_bytes(large)
    assert shutil.disk_usage(small_disk).free < neighbour  # sized by the neighbour, the save was refused
    new = small_disk / "out" / "new"
    reference = train(*stage, "--import-fix", "--steps", "5", "--save-state", new, "--save-state-at", "3")
    written = _saved_bytes(new)
    resume_from(stage, new, 3, tmp_path / "resumed.json")
    assert json.loads((tmp_path / "resumed.json").read_text())["losses"] == reference["losses"][3:5]

    other = small_disk / "out" / "other"
    full = child("fill:1", other, EXAMPLE, *stage, "--import-fix", "--steps", "2", "--save-state", other)
    assert full.returncode != 0
    need = re.search(rf"save_state\({other}\) ran out of disk space \(the disk is full\) after writing [\d.]+ KiB: it "
                     r"needs about ([\d.]+) KiB and", full.stderr)
    assert need, full.stderr[-3000:]
    assert 0.1 * written / 1024 < float(need.group(1)) <= written / 1024  # this run's, a lower bound of its save
    assert not list(small_disk.glob("out/.accel_ds_fix-*"))

    (small_disk / "out" / "filler").unlink()
    with open(small_disk / "out" / "filler", "wb") as f:  # a real disk with 4 KiB left: less than this run's states
        f.write(b"\0" * (shutil.disk_usage(small_disk).free - 4096))
    refused = child("count:" + str(tmp_path / "files.txt"), other, EXAMPLE, *stage, "--import-fix", "--steps", "2",
                    "--save-state", other)
    assert refused.returncode != 0
    assert re.search(rf"CheckpointError: accel_ds_fix: save_state\({other}\) needs about [\d.]+ KiB \(this run's "
                     r"weights and optimizer states\) and the disk has [\d.]+ KiB free\. Nothing was written\. Free "
                     "some space or save elsewhere.", refused.stderr), refused.stderr[-3000:]
    assert not (tmp_path / "files.txt").exists() and not other.exists()
    assert _saved_bytes(new) == written and _saved_bytes(large) == neighbour
