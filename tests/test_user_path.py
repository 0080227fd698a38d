"""What a user runs: each shipped configs/*.yaml under the real `accelerate launch` CLI, from a folder outside
the checkout, the script choosing its own precision; the configs `plan --write` makes; a config file that
cannot be found."""

import fcntl
import json
import shutil
import sys
from pathlib import Path

import pytest

from accel_ds_fix.memory import tiers
from conftest import EXAMPLE, ROOT, clean_env, run, skip_without_nvme

YAMLS = sorted((ROOT / "configs").glob("*.yaml"))
ACCELERATE = [Path(sys.executable).parent / "accelerate", "launch"]  # the console script users run


def launch(config, folder, *script_args, env=None, check=True):
    # bf16: DeepSpeed's CPU backend has no fp16; on a GPU the same files run with --mixed_precision fp16.
    cmd = [*ACCELERATE, "--config_file", config, EXAMPLE, "--mixed-precision", "bf16", *script_args]
    proc = run(cmd, env=env or clean_env(ACCEL_DS_FIX="1"), cwd=folder, check=check)
    return proc


@pytest.mark.quick
def test_configs_folder_is_what_the_tiers_write(tmp_path):
    # configs/ is made from accel_ds_fix/memory/tiers.py, which `python -m accel_ds_fix plan --write` also uses.
    for tier in tiers.TIERS:
        tiers.write(tier, tmp_path, relative=True)
    assert sorted(p.name for p in (ROOT / "configs").iterdir()) == sorted(p.name for p in tmp_path.iterdir())
    for made in tmp_path.iterdir():
        assert (ROOT / "configs" / made.name).read_text() == made.read_text(), made.name
    for yaml in YAMLS:  # accelerate refuses a mixed_precision key beside deepspeed_config_file
        assert not [line for line in yaml.read_text().splitlines() if line.startswith("mixed_precision")]


@pytest.fixture
def nvme_folder(request):
    # The NVMe tiers swap into tiers.DEFAULT_NVME_PATH, as shipped, and a run refuses a folder another live run
    # holds (nvme/swap_folder.py): the two NVMe configs' tests take turns across pytest's workers. Then remove what
    # this test put there.
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or "nvme" not in Path(callspec.params.get("config", "")).name:
        yield
        return
    with open(tiers.DEFAULT_NVME_PATH + ".tests.lock", "w") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        existed = Path(tiers.DEFAULT_NVME_PATH).exists()
        yield
        if not existed:
            shutil.rmtree(tiers.DEFAULT_NVME_PATH, ignore_errors=True)


@pytest.mark.parametrize("config", YAMLS, ids=[p.stem for p in YAMLS])
def test_shipped_yaml_trains_saves_and_resumes_from_another_folder(tmp_path, config, nvme_folder):
    if "nvme" in config.name:
        skip_without_nvme()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # into a folder whose parents do not exist yet, as scripts save (accelerate makes them)
    first = launch(config, elsewhere, "--steps", "6", "--save-state", "runs/exp1/ckpt", "--save-state-at", "3", "--out",
                   "a.json")
    resumed = launch(config, elsewhere, "--steps", "3", "--first-step", "3", "--resume", "runs/exp1/ckpt", "--out",
                     "b.json")
    a, b = (json.loads((elsewhere / f).read_text()) for f in ("a.json", "b.json"))
    assert a["fix_active"] and len(a["losses"]) == 6 and a["losses"][-1] != a["losses"][0]
    assert "accel_ds_fix" in first.stderr and "merged 2 models into one DeepSpeed engine" in first.stderr
    assert (elsewhere / "runs" / "exp1" / "ckpt" / "accel_ds_fix.json").exists()
    # The resume is exact in every shipped tier, with the example's decaying learning rate, for three steps:
    # under optimizer offload the scheduler's groups stay the engine's (checkpoints/param_groups.py; before, the
    # rate stayed at the save's and the third step parted by 1e-3 relative).
    assert b["losses"] == a["losses"][3:6]
    assert "Traceback" not in resumed.stderr


def test_written_config_runs_from_any_folder_without_the_fix_in_the_launcher(tmp_path):
    # `plan --write` names the JSON by its absolute path: plain `accelerate launch` finds it from anywhere,
    # and the script activates the fix itself (--import-fix).
    written = tmp_path / "cfg"
    proc = run([sys.executable, "-m", "accel_ds_fix", "plan", "--params", "2K", "--gpu-memory", "6GiB",
                "--host-memory", "64GiB", "--tier", "zero2-offload", "--write", written])
    assert f"wrote {written / 'accelerate_zero2_offload.yaml'}" in proc.stdout
    folder = tmp_path / "run"
    folder.mkdir()
    launch(written / "accelerate_zero2_offload.yaml", folder, "--import-fix", "--steps", "2", "--out", "a.json",
           env=clean_env())
    assert json.loads((folder / "a.json").read_text())["fix_active"]


def test_relative_config_file_not_found_is_one_clear_error(tmp_path):
    yaml = tmp_path / "cfg" / "accelerate.yaml"
    yaml.parent.mkdir()
    yaml.write_text((ROOT / "configs" / "accelerate_zero2_offload.yaml").read_text().replace(
        "ds_zero2_offload.json", "missing.json"))
    # In the launcher (ACCEL_DS_FIX=1 reaches `accelerate launch` itself):
    proc = launch(yaml, tmp_path, "--steps", "1", check=False)
    assert proc.returncode != 0
    assert (
        "accel_ds_fix: the DeepSpeed config file 'missing.json' named by " + str(yaml) + " is neither in the "
        "working directory (" + str(tmp_path) + ") nor beside that YAML (" + str(yaml.parent / "missing.json") + ")"
    ) in proc.stderr
    # Without the fix in the launcher, the training process (which imports it) says the same, before DeepSpeed.
    proc = launch(yaml, tmp_path, "--import-fix", "--steps", "1", env=clean_env(), check=False)
    assert proc.returncode != 0
    assert (
        "accel_ds_fix: the DeepSpeed config file 'missing.json' does not exist: accelerate looked for "
        + str(tmp_path / "missing.json") + ", relative to the working directory " + str(tmp_path)
    ) in proc.stderr
    assert "JSONDecodeError" not in proc.stderr
