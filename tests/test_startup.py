"""What every launch pays before training: DeepSpeed's and accelerate's probes, asked no more often than needed."""

import importlib.util
import sys

import pytest

from conftest import SCENARIOS, clean_env, result, run

COUNT_SUBPROCESSES = """
import sys
started = []
sys.addaudithook(lambda event, args: started.append(event) if event == "subprocess.Popen" else None)
import accel_ds_fix
from cpuinfo import get_cpu_info
first = get_cpu_info(); after_first = len(started)
second = get_cpu_info()
second["brand_raw"] = "changed by a caller"
third = get_cpu_info()
print(after_first, len(started) - after_first, first == third, first["brand_raw"] == third["brand_raw"])
"""


@pytest.mark.quick
def test_py_cpuinfo_is_asked_once_a_process():
    # DeepSpeed asks it three times while building its CPU Adam, and each call started a Python subprocess
    first, later, same, unchanged = run([sys.executable, "-c", COUNT_SUBPROCESSES]).stdout.split()
    assert int(first) >= 1 and int(later) == 0
    assert same == unchanged == "True"  # each caller gets its own copy of one answer


def test_optimizer_offload_maps_adamw_without_importing_bitsandbytes():
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed: accelerate never imports it")
    fixed = result(run([sys.executable, SCENARIOS, "offload_mapping_without_bnb_import"], env=clean_env()))
    reference = result(run([sys.executable, SCENARIOS, "offload_mapping_without_bnb_import", "--reference"],
                           env=clean_env()))
    assert fixed.pop("bitsandbytes_imported") is False and reference.pop("bitsandbytes_imported") is True
    assert fixed == reference  # the same optimizer, mode, decay and losses
    assert fixed["optimizer"] == "DeepSpeedCPUAdam" and fixed["adamw_mode"] is True
