"""Counts the suite's launches (docs/tests.md): on PYTHONPATH only where ACCEL_DS_FIX_TEST_LAUNCH_LOG names a file,
each Python process the tests start appends one line to it at exit: its pid, whether it imported DeepSpeed and its
command. It imports nothing more than the interpreter already has (the tests of what a process imports at start-up
run under it too)."""

import atexit
import os
import sys

LOG = os.environ.get("ACCEL_DS_FIX_TEST_LAUNCH_LOG")


def _write():
    with open(LOG, "a") as f:
        # warm: forked from tests/warm_start.py, whose imports it shares (its atexit runs this too)
        warm = os.path.basename(getattr(sys.modules.get("__main__"), "__file__", "") or "") == "warm_start.py"
        f.write(f"{os.getpid()} deepspeed={'deepspeed' in sys.modules} warm={warm} {' '.join(sys.argv)[:160]}\n")


if LOG:
    atexit.register(_write)
