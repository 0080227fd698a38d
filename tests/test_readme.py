"""The README's commands, run as written where a CPU machine can (the `accelerate launch` lines are run with
the shipped configs by test_user_path.py, the install lines by test_packaging.py)."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import accel_ds_fix
from accel_ds_fix.ops import libaio
from conftest import ROOT, clean_env, nvme_unavailable, run

README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent


def commands():
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_plan_commands_run_as_written():
    plan = next(c for c in commands() if c.startswith("python -m accel_ds_fix plan --params"))
    proc = run([BIN / "python", *plan.split()[1:]], env=clean_env())
    if nvme_unavailable():  # the plan says why instead, and recommends nothing it cannot run
        assert "zero3-nvme: cannot run here: " in proc.stdout and "no tier fits and runs here" in proc.stdout
    else:
        assert "recommended: zero3-nvme" in proc.stdout
    report = next(c for c in commands() if c == "python -m accel_ds_fix")
    assert "fix active:" in run([BIN / "python", *report.split()[1:]], env=clean_env()).stdout


def test_build_ops_command_leaves_every_op_built_or_says_why():
    # scripts/test.sh ran it before the suite: here every op is found built (or cannot be built, with the reason),
    # and the report then says cpu_adam is built.
    build = next(c for c in commands() if c == "python -m accel_ds_fix build-ops")
    out = run([BIN / "python", *build.split()[1:]], env=clean_env()).stdout
    for op in ("cpu_adam", "async_io", "deepspeed_shm_comm"):
        line = next(line for line in out.splitlines() if line.startswith(f"{op}: "))
        assert re.match(rf"{op}: (already built|built in \d+ s|cannot be built here: \S)", line), line
    assert "DeepSpeed cpu_adam op: built" in run([BIN / "python", "-m", "accel_ds_fix"], env=clean_env()).stdout


def test_wheel_command_builds_the_file_the_readme_installs(tmp_path):
    build, install = next(c for c in commands() if c.startswith("pip wheel")).split(" && ")
    wheel = install.split()[-1]
    assert wheel == f"dist/accel_ds_fix-{accel_ds_fix.__version__}-py3-none-any.whl"
    # The build as written, in a copy of the sources (no dist/ in the checkout), with this venv's pip.
    subprocess.run(["cp", "-r", *[str(ROOT / p) for p in ("setup.py", "setup.cfg", "pyproject.toml", "README.md",
                                                         "accel_ds_fix")], str(tmp_path)], check=True)
    proc = subprocess.run(build.replace("pip", f"{BIN / 'python'} -m pip", 1), shell=True, cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with zipfile.ZipFile(tmp_path / wheel) as built:
        assert "accel_ds_fix.pth" in built.namelist() and "accel_ds_fix/cli/commands.py" in built.namelist()


def test_demo_fails_without_the_fix_and_trains_with_it():
    proc = subprocess.run([ROOT / "scripts" / "demo.sh"], capture_output=True, text=True, env=clean_env(), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "AssertionError: You can't use same `Accelerator()` instance with multiple models" in proc.stdout
    assert "OK: fails without the fix, trains with it" in proc.stdout
    assert "accel_ds_fix: merged 2 models into one DeepSpeed engine (ZeRO stage 2)" in proc.stderr


def test_startup_bench_runs():
    proc = run([BIN / "python", ROOT / "bench" / "startup.py", "--pairs", "3"], env=clean_env())
    assert "cost of the variable: median" in proc.stdout and "ratio set/unset: median" in proc.stdout


def test_files_and_links_the_readme_names_exist():
    for path in set(re.findall(r"\b((?:configs|docs|bench|scripts|examples|accel_ds_fix)/[\w./-]+\.(?:yaml|json|md|py|sh))", README)):
        assert (ROOT / path).exists(), path


def test_nvme_commands_run_as_written(tmp_path):
    # The plan that measures the NVMe folder (made if missing, removed again here) and predicts 1600 steps.
    plan = next(c for c in commands() if c.startswith("python -m accel_ds_fix plan") and "--nvme-path" in c)
    folder = Path(plan.split("--nvme-path")[1].split()[0])
    existed = folder.exists()
    try:
        out = run([BIN / "python", *plan.split()[1:]], env=clean_env()).stdout
    finally:
        if not existed:
            shutil.rmtree(folder, ignore_errors=True)
    if nvme_unavailable():
        assert "NVMe folder not measured: zero3-nvme cannot run here" in out
    else:
        assert f"NVMe folder {folder}: its disk reads " in out and "hours for 1600 steps" in out
    # get-libaio, into a cache folder of this test's own (it writes to the user's cache as written).
    fetch = next(c for c in commands() if c.startswith("python -m accel_ds_fix get-libaio"))
    env = clean_env(XDG_CACHE_HOME=str(tmp_path))
    env.pop("ACCEL_DS_FIX_LIBAIO", None)  # the set-up's own folder: the command as a user runs it uses the cache
    proc = run([BIN / "python", *fetch.split()[1:]], env=env, check=False)
    if libaio.on_system():
        assert proc.returncode == 0 and "the system has it" in proc.stdout
    elif shutil.which("apt-get"):
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "accel_ds_fix" / "libaio" / "usr" / "include" / "libaio.h").exists()
    else:
        assert proc.returncode == 1 and "cannot fetch libaio here" in proc.stderr
