"""What every launch pays before training: DeepSpeed's and accelerate's probes, asked no more often than needed."""

import importlib.util
import sys

import pytest

from conftest import SCENARIOS, clean_env, result, run

COUNT_SUBPROCESSES = """
import json, sys
started = []
sys.addaudithook(lambda event, args: started.append(event) if event == "subprocess.Popen" else None)
import accel_ds_fix
from cpuinfo import get_cpu_info
before = len(started)  # importing py-cpuinfo starts processes of its own (file, uname)
first = get_cpu_info(); after_first = len(started)
second = get_cpu_info()
second["brand_raw"] = "changed by a caller"
third = get_cpu_info()
print(json.dumps({"first_call": after_first - before, "later_calls": len(started) - after_first,
                  "flags": first["flags"], "unchanged": first == third}))
"""


@pytest.mark.quick
def test_py_cpuinfo_is_asked_once_a_machine(tmp_path):
    # DeepSpeed asks it three times while loading its CPU ops, and each call started a Python subprocess (1.2 s)
    env = clean_env(TORCH_EXTENSIONS_DIR=str(tmp_path))
    first = result(run([sys.executable, "-c", COUNT_SUBPROCESSES], env=env))
    assert first["first_call"] >= 1 and first["later_calls"] == 0  # asked once in the process
    assert first["unchanged"] is True  # each caller gets its own copy of one answer
    assert len(list(tmp_path.glob("accel_ds_fix-cpuinfo-*.json"))) == 1  # kept beside DeepSpeed's built ops
    second = result(run([sys.executable, "-c", COUNT_SUBPROCESSES], env=env))
    assert second["first_call"] == 0 and second["flags"] == first["flags"]  # the next launch reads it


def test_optimizer_offload_maps_adamw_without_importing_bitsandbytes():
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed: accelerate never imports it")
    fixed = result(run([sys.executable, SCENARIOS, "offload_mapping_without_bnb_import"], env=clean_env()))
    reference = result(run([sys.executable, SCENARIOS, "offload_mapping_without_bnb_import", "--reference"],
                           env=clean_env()))
    assert fixed.pop("bitsandbytes_imported") is False and reference.pop("bitsandbytes_imported") is True
    assert fixed == reference  # the same optimizer, mode, decay and losses
    assert fixed["optimizer"] == "DeepSpeedCPUAdam" and fixed["adamw_mode"] is True
