"""Counts the suite's launches (docs/tests.md): on PYTHONPATH only where ACCEL_DS_FIX_TEST_LAUNCH_LOG names a file,
each Python process the tests start appends one line to it at exit: whether it imported DeepSpeed and how many
DeepSpeed engines it built."""

import atexit
import os
import sys

LOG = os.environ.get("ACCEL_DS_FIX_TEST_LAUNCH_LOG")
_engines = []


def _count_engines(module):
    original = module.DeepSpeedEngine.__init__

    def __init__(self, *args, **kwargs):
        _engines.append(1)
        original(self, *args, **kwargs)

    module.DeepSpeedEngine.__init__ = __init__


def _write():
    with open(LOG, "a") as f:
        f.write(f"{os.getpid()} deepspeed={'deepspeed' in sys.modules} engines={len(_engines)} {' '.join(sys.argv)[:160]}\n")


if LOG:
    import wrapt

    wrapt.register_post_import_hook(_count_engines, "deepspeed.runtime.engine")
    atexit.register(_write)
