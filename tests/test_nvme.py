"""The NVMe tier on a machine as a user has it: refused before anything is allocated where libaio is missing (the
system's own libaio hidden in a private mount namespace where the machine has one), with the tiers that do run;
`plan` and the report saying "cannot run here"; libaio fetched without root; the step's gradients kept in host
memory (8 bytes a parameter less through the disk, the same losses); the disk measured and the run's time
predicted."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from accel_ds_fix.memory import tiers
from accel_ds_fix.nvme import prerequisites as nvme_prerequisites
from accel_ds_fix.ops import libaio
from accel_ds_fix.units import size_in_words
from conftest import EXAMPLE, ROOT, clean_env, run, skip_without_nvme

PROBE = ROOT / "tests" / "nvme_probe.py"
ACCELERATE = Path(sys.executable).parent / "accelerate"
LAPTOP = ["--params", "983M", "--gpu-memory", "6GiB", "--host-memory", "15GiB"]
GIB = 1024**3


@pytest.fixture
def disk_folder(request):
    """A fresh folder on a disk (where the shipped tier swaps, not a tmpfs /tmp)."""
    parent = Path(tiers.DEFAULT_NVME_PATH).parent
    folder = Path(tempfile.mkdtemp(dir=parent))
    request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
    return folder


def probe(swap, mode, *args):
    proc = run([sys.executable, PROBE, swap, *args], env=clean_env(ACCEL_DS_FIX_NVME_GRADIENTS=mode), warm=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_step_takes_its_gradients_from_host_memory_with_the_same_losses(disk_folder):
    skip_without_nvme()
    host = probe(disk_folder / "host", "host", "--gas", "2", "--steps", "6")
    disk = probe(disk_folder / "disk", "disk", "--gas", "2", "--steps", "6")
    assert host["losses"] == disk["losses"] and host["losses"][-1] != host["losses"][0]
    assert host["optimizer_steps"] == disk["optimizer_steps"] == 3
    # DeepSpeed alone writes each gradient partition to the swap folder and reads it back in the step.
    assert [f for f in disk["swap_files"] if "_gradient_" in f]
    assert not [f for f in host["swap_files"] if "_gradient_" in f]
    per_step = {name: {key: run_[key] / run_["trained"] / run_["optimizer_steps"] for key in ("read_bytes", "write_bytes")}
                for name, run_ in (("host", host), ("disk", disk))}
    # fp32 weights and Adam's two states out every step: 12 bytes; DeepSpeed's gradient round trip adds 4 each way
    # (its reads of the just-written gradient files are partly served from the page cache, so fewer are counted).
    assert per_step["host"]["write_bytes"] == pytest.approx(12, abs=0.5)
    assert per_step["disk"]["write_bytes"] == pytest.approx(16, abs=0.5)
    assert per_step["disk"]["read_bytes"] > per_step["host"]["read_bytes"] + 1


def test_pipelined_swaps_train_the_same_and_keep_no_sub_group_in_host_memory(disk_folder):
    # The shipped tier reads the next sub group and writes the previous one while one steps: same values, same
    # bytes; between steps each swapped sub group's master weights and Adam states are on the disk only
    # (DeepSpeed 0.19.8's pipelined swapper alone keeps Adam's states of every sub group in host memory).
    skip_without_nvme()
    serial = probe(disk_folder / "serial", "host", "--gas", "2", "--steps", "6")
    pipelined = probe(disk_folder / "pipelined", "host", "--gas", "2", "--steps", "6", "--pipelined")
    assert pipelined["losses"] == serial["losses"] and serial["losses"][-1] != serial["losses"][0]
    assert pipelined["swapped_sub_groups"] == serial["swapped_sub_groups"] >= 3
    assert pipelined["elements_held_of_swapped_sub_groups"] == serial["elements_held_of_swapped_sub_groups"] == 0
    for key in ("read_bytes", "write_bytes"):
        assert pipelined[key] == pytest.approx(serial[key], rel=0.02), key
    assert not [f for f in pipelined["swap_files"] if "_gradient_" in f]


# accel_ds_fix.nvme_optimizer_ram_gib of the probe's config: its last two sub groups (263K and 1.05M elements, 16
# bytes each) fit, the two before them are swapped
RAM = ["--ram-gib", "0.02"]


def test_sub_groups_kept_in_ram_train_the_same_with_fewer_bytes_through_the_disk(disk_folder):
    # The shipped tier keeps its last sub groups within a host-memory budget off the disk: the same values in the
    # step (DeepSpeed's CPU Adam steps them either way), 24 bytes a kept parameter less through the disk.
    skip_without_nvme()
    kept = probe(disk_folder / "kept", "host", "--pipelined", "--steps", "6", *RAM)
    every = probe(disk_folder / "every", "host", "--pipelined", "--steps", "6")
    assert kept["losses"] == every["losses"] and kept["losses"][-1] != kept["losses"][0]
    sizes = kept["sub_group_sizes"]
    assert every["sub_groups_in_ram"] == [] and kept["sub_groups_in_ram"] == [len(sizes) - 2, len(sizes) - 1]
    assert kept["swapped_sub_groups"] == len(sizes) - 2 and kept["elements_held_of_swapped_sub_groups"] == 0
    assert len(kept["swap_files"]) == 3 * kept["swapped_sub_groups"]  # weights and two Adam states each
    swapped = sum(n for i, n in enumerate(sizes) if i not in kept["sub_groups_in_ram"]) / sum(sizes)
    assert kept["write_bytes"] == pytest.approx(every["write_bytes"] * swapped, rel=0.03)


def test_an_nvme_checkpoint_resumes_as_if_never_interrupted_in_its_layout_and_under_another_budget(disk_folder):
    # DeepSpeed 0.19.8 copies the swap files back but its swapper never learns of the Adam states in them: the
    # resumed step started Adam over (moments zero, step 1). With the fix the resumed run goes on bit for bit as
    # the uninterrupted one, in the layout that saved it, and converted (one line) where the sub groups kept in
    # RAM differ (the shipped tier's budget against a config without one).
    skip_without_nvme()
    ckpt = disk_folder / "ckpt"
    whole = probe(disk_folder / "whole", "host", "--pipelined", "--steps", "6")
    probe(disk_folder / "save", "host", "--pipelined", "--steps", "3", "--save-state", ckpt, "--save-after", "3")
    resume = [sys.executable, PROBE, disk_folder / "resume", "--pipelined", "--steps", "6", "--resume", ckpt,
              "--first-step", "3"]
    same = json.loads(run(resume).stdout.strip().splitlines()[-1])
    assert same["losses"] == whole["losses"][3:] and len(set(same["losses"])) == 3
    proc = run([*resume, *RAM])
    other = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "optimizer on NVMe, bf16; this run is ZeRO-3, 1 process, optimizer on NVMe (2 sub group(s) of it in RAM)," \
           " bf16: converted it" in proc.stderr
    assert other["sub_groups_in_ram"] and other["losses"] == whole["losses"][3:]


def test_a_run_killed_in_the_middle_of_a_pipelined_step_resumes_its_checkpoint(disk_folder):
    """About 20 s: three runs (the uninterrupted one, the one killed with kill -9 in a step, the resume), each
    swapping to a real disk."""
    # kill -9 while a sub group's write is in flight and the next one is being read, as the shipped tier runs
    # (its last sub groups in RAM): the swap folder is left half-stepped; a new run resuming the checkpoint gives
    # the losses of a clean resume, which are the uninterrupted run's, bit for bit.
    skip_without_nvme()
    ckpt, swap = disk_folder / "ckpt", disk_folder / "swap"
    probe(swap, "host", "--pipelined", *RAM, "--steps", "3", "--save-state", ckpt, "--save-after", "3")
    resume = ["--pipelined", *RAM, "--steps", "6", "--resume", ckpt, "--first-step", "3"]
    clean = probe(disk_folder / "clean", "host", *resume)
    whole = probe(disk_folder / "whole", "host", "--pipelined", *RAM, "--steps", "6")
    groups = clean["swapped_sub_groups"]
    assert groups >= 2 and clean["sub_groups_in_ram"] and clean["losses"] == whole["losses"][3:]
    killed = run([sys.executable, PROBE, swap, *resume, "--kill-at-swap-out", str(groups + groups // 2)],
                 env=clean_env(), check=False, warm=True)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert '"losses"' not in killed.stdout  # it died in its second step, before its results
    after = probe(swap, "host", *resume)
    assert after["losses"] == clean["losses"]


def test_a_budget_that_is_not_one_is_refused_before_anything_is_allocated(disk_folder):
    proc = run([sys.executable, PROBE, disk_folder / "bad", "--ram-gib", "-1"], env=clean_env(), check=False, warm=True)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert ("ConfigError: accel_ds_fix: accel_ds_fix.nvme_optimizer_ram_gib in the DeepSpeed config is -1.0; it must "
            "be a number of GiB, 0 or more") in proc.stderr and "Nothing was allocated" in proc.stderr
    assert not (disk_folder / "bad").exists()  # DeepSpeed never started: no swap folder


def _hide_system_libaio():
    """A command prefix that runs its command with the system's libaio out of sight (a private mount namespace,
    /dev/null bound over libaio.h and the library), or None where that cannot be done here."""
    if not libaio.on_system():
        return []  # nothing to hide: this machine lacks libaio already
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    library = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    paths = [line.split("=>")[-1].strip() for line in library.splitlines() if "libaio.so" in line]
    hidden = {os.path.realpath(p) for p in paths} | {h for h in ("/usr/include/libaio.h", "/usr/local/include/libaio.h")
                                                     if os.path.exists(h)}
    mounts = " && ".join(f"mount --bind /dev/null {p}" for p in sorted(hidden))
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh"]


def test_without_libaio_the_nvme_tier_stops_before_allocating_and_plan_says_why(tmp_path):
    prefix = _hide_system_libaio()
    if prefix is None:
        pytest.skip("the system has libaio, and hiding it needs root and unshare: the refusal runs where either holds")
    # DeepSpeed's other ops as built, but no async_io built against the libaio of this machine or of the set-up.
    extensions = tmp_path / "extensions"
    extensions.mkdir()
    built = Path(os.environ.get("TORCH_EXTENSIONS_DIR", ROOT / ".cache" / "torch_extensions"))
    for op in ("cpu_adam", "deepspeed_shm_comm"):
        if (built / op).exists():
            (extensions / op).symlink_to(built / op)
    env = clean_env(ACCEL_DS_FIX="1", TORCH_EXTENSIONS_DIR=str(extensions), XDG_CACHE_HOME=str(tmp_path / "cache"),
                    ACCEL_DS_FIX_LIBAIO=str(tmp_path / "no-libaio"))
    launch = run([*prefix, ACCELERATE, "launch", "--config_file", ROOT / "configs" / "accelerate_zero3_nvme.yaml", EXAMPLE,
                  "--mixed-precision", "bf16", "--steps", "2"], env=env, check=False, cwd=tmp_path)
    assert launch.returncode != 0
    assert ("PrerequisiteError: accel_ds_fix: this DeepSpeed config offloads to NVMe, which cannot run here: libaio "
            "is missing, and DeepSpeed's async_io op cannot be built without it") in launch.stderr
    for words in ("sudo apt install libaio-dev", "sudo dnf install libaio-devel", "conda install -c conda-forge libaio",
                  "python -m accel_ds_fix get-libaio", "Shipped configs that run here: zero2-offload", "Nothing was allocated"):
        assert words in launch.stderr, words
    assert "Unable to JIT load" not in launch.stderr  # DeepSpeed's own words never came: it was stopped first
    assert "merged 2 models" not in launch.stderr

    plan = run([*prefix, sys.executable, "-m", "accel_ds_fix", "plan", *LAPTOP, "--json"], env=env)
    out = json.loads(plan.stdout)
    rows = {r["tier"]: r for r in out["tiers"]}
    assert rows["zero3-nvme"]["fits"] and not rows["zero3-nvme"]["can_run_here"]
    assert rows["zero3-nvme"]["cannot_run_here"].startswith("libaio is missing")
    assert rows["zero2-offload"]["can_run_here"] and out["recommended"] is None
    text = run([*prefix, sys.executable, "-m", "accel_ds_fix", "plan", *LAPTOP], env=env).stdout
    assert "zero3-nvme: cannot run here: libaio is missing" in text and "recommended:" not in text
    report = run([*prefix, sys.executable, "-m", "accel_ds_fix"], env=env).stdout
    assert "zero3-nvme     cannot run here: libaio is missing" in report
    assert "zero2-offload  can run here" in report


def test_an_nvme_folder_in_ram_or_without_room_is_named(disk_folder):
    if (nvme_prerequisites.filesystem_of("/dev/shm") or (None, None))[1] != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    in_ram = tempfile.mkdtemp(dir="/dev/shm")
    try:
        out = json.loads(run([sys.executable, "-m", "accel_ds_fix", "plan", *LAPTOP, "--nvme-path", in_ram,
                              "--json"]).stdout)
    finally:
        shutil.rmtree(in_ram)
    row = next(r for r in out["tiers"] if r["tier"] == "zero3-nvme")
    assert not row["can_run_here"] and "is on tmpfs (/dev/shm), which is host memory" in row["cannot_run_here"]
    assert nvme_prerequisites.direct_io_problem(str(disk_folder / "swap")) is None
    config = tiers.BY_NAME["zero3-nvme"].deepspeed_config(str(disk_folder))
    free = nvme_prerequisites.free_bytes(disk_folder)
    errors, warnings = nvme_prerequisites.room_problems(config, free + GIB, GIB)
    assert errors and errors[0].startswith(f"disk: the NVMe offload folder {disk_folder} needs ") and not warnings
    errors, warnings = nvme_prerequisites.room_problems(config, GIB, free)
    assert not errors and "each save_state writes about" in warnings[0]


@pytest.mark.quick
def test_nvme_room_messages_show_small_sizes_in_a_unit_that_shows_them(tmp_path):
    # A tiny model's swap files and checkpoint read "0.0 GiB" before (issue 41, item 6).
    config = tiers.BY_NAME["zero3-nvme"].deepspeed_config(str(tmp_path))
    free = nvme_prerequisites.free_bytes(tmp_path)
    _, warnings = nvme_prerequisites.room_problems(config, 5 * 2**20, free)
    assert "the swap files take 5.0 MiB and each save_state writes about " in warnings[0], warnings
    assert [size_in_words(n) for n in (300 * 2**10, 5 * 2**20, 3 * GIB, 40 * GIB)] == [
        "300.0 KiB", "5.0 MiB", "3.00 GiB", "40.0 GiB"]


def test_plan_measures_the_nvme_folder_and_predicts_the_run(disk_folder):
    skip_without_nvme()
    out = json.loads(run([sys.executable, "-m", "accel_ds_fix", "plan", *LAPTOP, "--nvme-path", disk_folder,
                          "--steps", "1600", "--json"]).stdout)
    timing = out["nvme_timing"]
    assert timing["measured"] and timing["read_gb_per_s"] > 0 and timing["write_gb_per_s"] > 0
    assert list(disk_folder.iterdir()) == []  # the measuring files are gone
    rows = {r["gradient_accumulation"]: r for r in timing["per_accumulation"]}
    assert sorted(rows) == [1, 2, 4]
    # 12 bytes a swapped parameter each way, once per optimizer step, whatever the accumulation; the shipped tier
    # reads and writes at once (pipelined), at the speed measured that way, and keeps its last sub groups in the
    # host memory this laptop leaves (the plan lowers the shipped 1.5 GiB to fit 15 GiB), off the disk.
    assert timing["pipelined"] and timing["both_gb_per_s"] > 0
    assert 0 < timing["kept_in_ram_gib"] < 1.5 and 0 < timing["trained_in_ram"] < 100e6
    swapped = 983e6 - timing["trained_in_ram"]
    disk = 2 * 12 * swapped / 1e9 / timing["both_gb_per_s"]
    for k, r in rows.items():
        assert r["disk_seconds"] == pytest.approx(disk, abs=0.1)
        assert r["seconds_per_step"] == pytest.approx(disk + k * timing["compute_seconds"], abs=0.2)
        assert r["hours"] == pytest.approx(1600 * r["seconds_per_step"] / 3600, abs=0.1)
        assert r["disk_written_gb"] == pytest.approx(1600 * 12 * swapped / 1e9, rel=0.01)
    text = run([sys.executable, "-m", "accel_ds_fix", "plan", *LAPTOP, "--nvme-path", disk_folder, "--steps", "1600"]).stdout
    assert f"NVMe folder {disk_folder}: its disk reads " in text and "hours for 1600 steps" in text
    assert "GB/s reading and writing at once" in text
    assert f"M of the trained parameters step in RAM, off the disk: the config's accel_ds_fix.nvme_optimizer_ram_gib, " \
           f"{timing['kept_in_ram_gib']} GiB)" in text


def test_get_libaio_unpacks_debians_packages_without_root_or_says_the_system_has_it(tmp_path):
    target = tmp_path / "libaio"
    proc = run([sys.executable, "-m", "accel_ds_fix", "get-libaio", target], check=False)
    if libaio.on_system():
        assert proc.returncode == 0 and "the system has it" in proc.stdout and not target.exists()
        return
    if shutil.which("apt-get") is None:
        assert proc.returncode == 1 and "apt-get" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    assert (target / "usr" / "include" / "libaio.h").exists()
    assert list(target.glob("usr/lib/**/libaio.so.1*"))


def test_a_killed_get_libaio_leaves_nothing_half_done(tmp_path):
    # Killed at several points of the fetch (apt's download, the unpacking), the folder is either absent or whole,
    # never a header beside a missing or truncated library; the next fetch completes and clears what was left.
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("no apt-get or dpkg-deb here (not Debian or Ubuntu): get-libaio says so instead")
    target = tmp_path / "cache" / "libaio"  # in a folder not made yet, as ~/.cache/accel_ds_fix on a first fetch
    fetch = [sys.executable, "-c", f"from accel_ds_fix.ops import libaio; libaio.fetch({str(target)!r})"]
    for delay in (0.5, 1.0, 1.5, 2.0, 3.0):
        child = subprocess.Popen(fetch, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            child.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if target.exists():
            assert libaio.local_folder_at(str(target)) and list(target.glob("usr/lib/**/libaio.so.1*"))
            break
    proc = run(fetch)
    assert libaio.local_folder_at(str(target)) and not list(target.parent.glob("libaio.partial-*")), proc.stderr
    code = "from accel_ds_fix.ops import libaio; from accel_ds_fix.nvme import prerequisites as nvme_prerequisites; print(libaio.activate()); print(nvme_prerequisites.async_io_problem())"
    out = run([sys.executable, "-c", code], env=clean_env(ACCEL_DS_FIX_LIBAIO=str(target))).stdout.splitlines()
    assert out[-1] == "None"  # the fetched folder serves DeepSpeed's compatibility check (or the system's libaio does)


def test_a_build_killed_halfway_does_not_hang_the_next_run(tmp_path):
    """Over 60 s (94 s): it compiles one of DeepSpeed's ops from scratch twice, once killed halfway, in its own
    extension folder (the build and the kill are what is tested)."""
    # torch builds an op under a lock file that only the builder removes; an OOM kill or kill -9 halfway through
    # DeepSpeed's first compile left it, and every later run waited on it forever. The next build removes a lock
    # that no live process holds and builds. (The CPU's shared-memory op: the quickest of DeepSpeed's ops.)
    env = clean_env(TORCH_EXTENSIONS_DIR=str(tmp_path))
    build = [sys.executable, "-c", "from accel_ds_fix.ops import builds; builds.build(('ShareMemCommBuilder',))"]
    child = subprocess.Popen(build, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    for line in child.stdout:  # "building ..." is said just before torch takes the lock
        if "building" in line:
            break
    for _ in range(600):
        if lock.exists() or child.poll() is not None:
            break
        time.sleep(0.1)
    if not lock.exists():
        child.kill()
        pytest.skip("DeepSpeed's CPU backend has no shared-memory op to build here")
    time.sleep(2)  # the compilers at work
    os.killpg(child.pid, 9)  # the whole build, compilers included, as a power cut would
    child.wait()
    assert lock.exists()
    proc = run(build, env=env, timeout=900)
    assert "deepspeed_shm_comm: removed the lock of a build that was killed halfway" in proc.stdout
    assert "deepspeed_shm_comm: built in" in proc.stdout and not lock.exists()


def test_swap_files_of_a_killed_run_are_removed_and_a_live_run_is_never_clobbered(disk_folder):
    """DeepSpeed leaves its NVMe swap files behind when a run is killed, and a second run on the same folder writes
    over a live one's. A run on the folder while another lives is refused before anything is allocated; the run
    after a kill -9 removes what the killed one left (counted as room, said), names what dead runs left in process
    folders it does not use (clean-swap removes those), and its own clean exit leaves no swap file."""
    skip_without_nvme()
    stage = ["--zero-stage", "3", "--offload", "nvme", "--nvme-path", str(disk_folder), "--width", "512",
             "--import-fix"]
    log = open(disk_folder.parent / f"{disk_folder.name}.log", "w")  # a file: a full pipe would stop the run
    live = subprocess.Popen([sys.executable, EXAMPLE, *stage, "--steps", "100000"], env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while not list(disk_folder.rglob("*.tensor.swp")) and live.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert live.poll() is None and list(disk_folder.rglob("*.tensor.swp")), "the long run swapped nothing"
        second = run([sys.executable, EXAMPLE, *stage, "--steps", "2"], env=clean_env(), check=False, warm=True)
        assert second.returncode != 0
        assert (f"ConfigError: accel_ds_fix: the NVMe folder {disk_folder} is in use by another run (pid {live.pid}: "
                in second.stderr)
        assert "Nothing was allocated." in second.stderr and "step 0: loss" not in second.stdout
    finally:
        live.kill()
        live.wait()
        log.close()
        os.unlink(log.name)
    left = sum(f.stat().st_size for f in disk_folder.rglob("*.tensor.swp"))
    assert left > 0  # kill -9: DeepSpeed removed nothing
    # a dead two-process run's second process folder, which a one-process run does not use
    shutil.copytree(disk_folder / "zero_stage_3" / "optimizer" / "rank0", disk_folder / "zero_stage_3" / "optimizer" / "rank1")
    after = run([sys.executable, EXAMPLE, *stage, "--steps", "2"], env=clean_env(), warm=True)
    assert (f"removed {left / 2**20:.1f} MiB of NVMe swap files in {disk_folder} (process 0) that a run which did not "
            "end cleanly left; this run swaps into their place") in after.stderr
    assert (f"{disk_folder} also holds {left / 2**20:.1f} MiB of NVMe swap files that dead runs left (process folders "
            f"1), which this run does not use: `python -m accel_ds_fix clean-swap {disk_folder}` removes them"
            in after.stderr)
    assert "step 1: loss" in after.stdout
    assert not list((disk_folder / "zero_stage_3" / "optimizer" / "rank0").rglob("*.swp"))  # its clean exit
    cleaned = run([sys.executable, "-m", "accel_ds_fix", "clean-swap", str(disk_folder)], env=clean_env())
    assert f"removed {left / 2**30:.2f} GiB of NVMe swap files that dead runs left in {disk_folder}" in cleaned.stdout
    assert not list(disk_folder.rglob("*.swp"))


def test_swap_files_of_dead_runs_count_as_room(disk_folder):
    # What a dead run left in this run's process folders is removed before the run swaps: room, not use.
    config = tiers.BY_NAME["zero3-nvme"].deepspeed_config(str(disk_folder))
    free = nvme_prerequisites.free_bytes(disk_folder)
    stale = disk_folder / "zero_stage_3" / "optimizer" / "rank0"
    stale.mkdir(parents=True)
    with open(stale / "7.tensor.swp", "wb") as f:  # as large as the disk's free space, without using it (sparse)
        f.truncate(free)
    errors, _ = nvme_prerequisites.room_problems(config, free + 2**30, 0)
    assert not errors
    (stale / "7.tensor.swp").unlink()
    errors, _ = nvme_prerequisites.room_problems(config, free + 2**30, 0)
    assert errors and "needs " in errors[0]
