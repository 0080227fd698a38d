"""The warm start (tests/warm_start.py) that most training runs of the suite go through: a forked child must look,
to the test that ran it, like `python SCRIPT ARGS` started fresh."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import clean_env, run

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    how = sys.argv[1]
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "setting", os.environ.get("WARM_TEST_SETTING"))
    print("fix imported", "accel_ds_fix" in sys.modules, "deepspeed imported", "deepspeed" in sys.modules)
    print("to stderr", file=sys.stderr)
    sys.stdout.flush()  # before a kill: unflushed output is lost by a fresh process as by a warm one
    if how == "exit":
        sys.exit(3)
    if how == "raise":
        raise ValueError("raised in the script")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "ctrl-c":
        os.kill(os.getpid(), signal.SIGINT)
    if how == "sleep":
        with open(sys.argv[2], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(SCRIPT)
    return path


def both(script, *args, **kwargs):
    """(fresh, warm) runs of the same command."""
    cmd = [sys.executable, script, *args]
    return run(cmd, check=False, **kwargs), run(cmd, check=False, warm=True, **kwargs)


@pytest.mark.parametrize("how, code", [("exit", 3), ("raise", 1), ("kill", -signal.SIGKILL), ("ctrl-c", -signal.SIGINT),
                                       ("ok", 0)])
def test_a_warm_child_ends_and_says_what_a_fresh_one_would(script, tmp_path, how, code):
    env = clean_env(WARM_TEST_SETTING="seen")
    fresh, warm = both(script, how, env=env, cwd=tmp_path)
    if how == "ctrl-c" and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        code = 0  # a pytest-xdist worker ignores SIGINT, and so do the processes it starts
    assert fresh.returncode == warm.returncode == code
    assert warm.stdout.splitlines()[0] == fresh.stdout.splitlines()[0]
    assert f"argv ['{how}'] cwd {tmp_path} setting seen" in warm.stdout
    # the server imports DeepSpeed before forking, never the fix: a reference run stays without it
    assert "fix imported False" in warm.stdout
    assert "to stderr" in warm.stderr
    if how == "raise":
        assert "ValueError: raised in the script" in warm.stderr
        assert warm.stderr.count("Traceback") == fresh.stderr.count("Traceback") == 1


def test_a_warm_child_past_its_time_is_killed_as_subprocess_run_would(script, tmp_path):
    pid_file = tmp_path / "pid"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run([sys.executable, script, "sleep", pid_file], timeout=5, warm=True)
    assert time.monotonic() - started < 60
    assert "argv ['sleep'" in raised.value.output
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, and reaped by the server
    # the server goes on serving
    assert run([sys.executable, script, "ok"], warm=True).returncode == 0


@pytest.mark.parametrize("setting", [{"OMP_NUM_THREADS": "1"}, {"PYTHONUNBUFFERED": "1"}])
def test_a_setting_read_at_start_gets_a_fresh_process(script, setting):
    # OpenMP reads OMP_NUM_THREADS when torch loads it, the interpreter PYTHONUNBUFFERED as it starts: the server
    # did both before any request
    setting = {k: v for k, v in setting.items() if os.environ.get(k) != v}
    if not setting:
        pytest.skip("the suite itself runs with this setting")
    fresh_only = run([sys.executable, script, "ok"], env=clean_env(**setting), warm=True)
    assert "deepspeed imported False" in fresh_only.stdout
    warm = run([sys.executable, script, "ok"], warm=True)
    assert "deepspeed imported True" in warm.stdout


def test_a_run_about_the_import_order_gets_a_fresh_process(script):
    # the example's --import-fix-first imports the fix before accelerate, which the server has imported already
    proc = run([sys.executable, script, "ok", "--import-fix-first"], warm=True)
    assert "deepspeed imported False" in proc.stdout
