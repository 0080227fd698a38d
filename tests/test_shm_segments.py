"""DeepSpeed's CPU shared-memory segments (69 MB of RAM each in /dev/shm) are gone once a run has started, and stay
gone when the run ends or is killed; without the fix each run leaves one per process until reboot.

DeepSpeed's shm op makes them only when LOCAL_SIZE equals the world size (DeepSpeed's own launcher sets it; the
tests set it as that launcher does). Each run gets a port of its own, which the segment names hold.
"""

import os
import signal
import subprocess
import sys
import threading

import pytest

from conftest import EXAMPLE, ROOT, SHM_DIR, clean_env, free_port, remove_shm_segments, shm_segments
from test_training import launch

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm here: DeepSpeed's CPU shm op makes no "
                                                             "segments to leave behind")

ZERO2_BF16 = ["--zero-stage", "2", "--mixed-precision", "bf16"]


def one_process_env(port, **extra):
    # What examples/train_two_models.py sets for itself when no launcher did, with a port the test knows.
    return clean_env(LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                     LOCAL_RANK="0", **extra)


def test_one_process_run_leaves_no_segment(train):
    port = free_port()
    try:
        result = train(*ZERO2_BF16, "--import-fix", env=one_process_env(port))
        assert result["fix_active"] and len(result["losses"]) == 6
        assert shm_segments(port) == []
    finally:
        remove_shm_segments(port)  # what a failing run left


def test_one_process_run_without_the_fix_leaves_its_segment(train):
    # The same models trained without the package (the hand-written merge): what the test above would find
    # if the fix did nothing.
    port = free_port()
    try:
        result = train(*ZERO2_BF16, "--reference", env=one_process_env(port))
        assert not result["fix_active"]
        assert shm_segments(port) == [f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_0"]
        assert (SHM_DIR / shm_segments(port)[0]).stat().st_size > 60_000_000
    finally:
        remove_shm_segments(port)


def test_two_process_launch_trains_alike_and_leaves_no_segment(train):
    port, reference_port = free_port(), free_port()
    while reference_port == port:
        reference_port = free_port()
    try:
        fixed = train(launcher=[*launch(2), "--main_process_port", str(port)],
                      env=clean_env(ACCEL_DS_FIX="1", LOCAL_SIZE="2"))
        assert fixed["fix_active"]
        assert shm_segments(port) == []
        reference = train("--reference", launcher=[*launch(2), "--main_process_port", str(reference_port)],
                          env=clean_env(LOCAL_SIZE="2"))
        assert len(shm_segments(reference_port)) == 2  # without the fix: one per process
    finally:
        remove_shm_segments(port)  # what a failing run left
        remove_shm_segments(reference_port)
    assert fixed["losses"] == reference["losses"]


def test_killed_run_leaves_no_segment(tmp_path):
    port = free_port()
    env = one_process_env(port, PYTHONUNBUFFERED="1")
    stderr = open(tmp_path / "stderr.txt", "w")
    child = subprocess.Popen([sys.executable, EXAMPLE, *ZERO2_BF16, "--import-fix", "--steps", "100000"], env=env,
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    watchdog = threading.Timer(300, child.kill)  # a child that never trains must not hang the suite
    watchdog.start()
    try:
        training = any(line.startswith("step 0:") for line in child.stdout)  # stops at the first match
        assert training, f"the run ended before training: {(tmp_path / 'stderr.txt').read_text()[-3000:]}"
        assert shm_segments(port) == []  # gone while it trains: removed at start-up, not at exit
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
        assert shm_segments(port) == []
    finally:
        watchdog.cancel()
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        stderr.close()
        remove_shm_segments(port)
