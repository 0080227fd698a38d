"""Helpers shared by the tests: every training runs in a fresh process on the real accelerate + DeepSpeed stack
(one process group and one AcceleratorState per process, as in real use)."""

import functools
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_two_models.py"
SCENARIOS = Path(__file__).resolve().parent / "scenarios.py"


def pytest_collection_modifyitems(items):
    # The tests whose docstring says how long they take ("Over 60 s (94 s)", "About 30 s") start first, the
    # longest first, so that two workers do not end with one of them alone on a long test (docs/tests.md).
    def seconds(item):
        doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
        said = re.search(r"(?:Over|About) (\d+) s(?: \((\d+) s)?", doc)
        return int(said.group(2) or said.group(1)) if said else 0

    items.sort(key=seconds, reverse=True)  # stable: the rest keep their order


def result(proc):
    """The JSON line a scenario or child prints last."""
    return json.loads(proc.stdout.strip().splitlines()[-1])


def clean_env(**extra):
    # ACCEL_DS_FIX_LIBAIO stays: it is where the set-up put libaio, not a setting a test chooses; so does the file
    # that counts launches.
    kept = ("ACCEL_DS_FIX_LIBAIO", "ACCEL_DS_FIX_TEST_LAUNCH_LOG")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "ACCEL_DS_FIX")) or k in kept}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra)
    if env.get("ACCEL_DS_FIX_TEST_LAUNCH_LOG"):  # counting the suite's launches (tests/launch_count)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests" / "launch_count"), env.get("PYTHONPATH")]))
    return env


# Seen once in ~50 runs of a fresh CI clone on 2 cores (and often where two launches shared port 29500, which
# with_own_port now prevents): a child that had trained and written its results died in torch's gloo teardown with
# this C++ abort (pytorch issue 190489). It says nothing about the results, but a result from such a run is not
# taken either: the run is made again, at most twice, and the last must exit cleanly (a two-process ZeRO-3 + NVMe
# launch aborted so twice in a row beside another worker's NVMe tests on 2 cores, and 0 of 10 times alone or in
# pairs of its own). Under `accelerate launch` the child's abort is in the middle of stderr and the launcher exits
# with 1.
TEARDOWN_ABORT = "terminate called without an active exception"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_own_port(cmd):
    """An `accelerate launch` gets a port of its own; returns (command, the port it added or None). Two pytest workers
    launching at once both asked for 29500: the second fell back to accelerate's standalone mode, and DeepSpeed's
    shared-memory comm op (its segment names hold MASTER_PORT) then ran beside the other job; 2 of 10 such pairs
    aborted a rank at exit ("terminate called without an active exception"), 0 of 12 with a port each."""
    cmd = [str(c) for c in cmd]
    launch = [i for i, c in enumerate(cmd) if c == "accelerate.commands.launch"
              or c == "launch" and i and os.path.basename(cmd[i - 1]) == "accelerate"]
    if launch and "--main_process_port" not in cmd:
        port = free_port()
        cmd[launch[0] + 1:launch[0] + 1] = ["--main_process_port", str(port)]
        return cmd, port
    return cmd, None


SHM_DIR = Path("/dev/shm")


def shm_segments(port):
    """DeepSpeed's CPU shared-memory segments of the launch on ``port`` (shm.cpp names them
    deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>)."""
    name = re.compile(rf"deepspeed_allreduce_buffer_{os.getuid()}_.*_{port}_\d+")
    return sorted(p.name for p in SHM_DIR.glob("deepspeed_allreduce_buffer_*") if name.fullmatch(p.name))


def remove_shm_segments(port):
    """A run without the fix (a reference) leaves its segments (69 MB of RAM each) until reboot. Only those of
    ``port``: another job's fresh segment, removed before its peers opened it, would make them wait forever."""
    for name in shm_segments(port):
        try:
            (SHM_DIR / name).unlink()
        except FileNotFoundError:
            pass


_warm = None


def warm_starter():
    """This worker's warm start (tests/warm_start.py), made at its first use."""
    global _warm
    if _warm is None:
        import atexit

        import warm_start

        _warm = warm_start.WarmStarter(clean_env(), ROOT)
        atexit.register(_warm.close)
    return _warm


def run(cmd, env=None, timeout=600, check=True, cwd=ROOT, warm=False):
    """subprocess.run with the suite's settings; ``warm``: a `python SCRIPT` run forked from a process that has
    imported torch, accelerate and DeepSpeed already (tests/warm_start.py), where its environment allows."""
    def once():
        command, port = with_own_port(cmd)
        child_env = env or clean_env()
        if port is None and "LOCAL_SIZE" in child_env and "RANK" not in child_env and command[1:2] and \
                command[1].endswith(".py"):
            # A one-process script under LOCAL_SIZE (test_matrix's older releases) makes a segment named after the
            # port it picks itself (single_process_env): it gets the same variables here, with a port known to us.
            port = free_port()
            child_env = {**child_env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                         "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        try:
            if warm and command[0] == sys.executable and command[1].endswith(".py") and \
                    warm_starter().can_start(command, child_env):
                return warm_starter().run(command, child_env, cwd, timeout)
            return subprocess.run(command, env=child_env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        finally:
            if port is not None:  # the port is this run's alone, so are its segments
                remove_shm_segments(port)

    proc = once()
    for _ in range(2):
        if proc.returncode == 0 or TEARDOWN_ABORT not in proc.stderr:
            break
        print(f"{cmd}: aborted in teardown, running it again", file=sys.stderr)
        proc = once()
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture
def train(tmp_path):
    """Run examples/train_two_models.py with these arguments; return its JSON results."""
    counter = iter(range(1000))

    def _train(*args, env=None, launcher=()):
        out = tmp_path / f"result{next(counter)}.json"
        script = [*launcher, EXAMPLE] if launcher else [sys.executable, EXAMPLE]
        run([*script, *args, "--out", out], env=env, warm=not launcher)
        return json.loads(out.read_text())

    return _train


@pytest.fixture
def scenario():
    """Run one function of tests/scenarios.py in a process of its own (forked warm: tests/warm_start.py); return
    the CompletedProcess."""

    def _scenario(name, *args, check=True):
        proc = run([sys.executable, SCENARIOS, name, *args], check=check, warm=True)
        return proc

    return _scenario


@functools.lru_cache(maxsize=None)
def nvme_unavailable():
    """Why the NVMe tier cannot run on this machine (libaio, a direct-I/O folder), or None when it can. Asked in a
    child: the check puts a set-up's libaio on this process's build paths, which the tests' children would inherit."""
    code = ("import json; from accel_ds_fix.nvme import prerequisites as nvme_prerequisites; from accel_ds_fix.memory import tiers; "
            "print(json.dumps(nvme_prerequisites.problems(tiers.BY_NAME['zero3-nvme'].deepspeed_config())))")
    problems = json.loads(run([sys.executable, "-c", code]).stdout.strip().splitlines()[-1])
    return "; ".join(problems) or None


def skip_without_nvme():
    """Skip, saying why and what to install, where the NVMe tier cannot run (scripts/setup-venv.sh provides libaio
    where it can: the skip is for machines where it could not)."""
    reason = nvme_unavailable()
    if reason:
        pytest.skip(f"the NVMe tier cannot run on this machine: {reason}")
