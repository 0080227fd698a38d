"""The one reader of a DeepSpeed config (issue 40): a section left out and one set to null mean the same
everywhere, "auto" is read one way, and prepare() takes a null section as DeepSpeed does."""

import pytest

from accel_ds_fix import deepspeed_config as ds
from conftest import result

NULLS = {"zero_optimization": {"stage": 2, "offload_optimizer": None, "offload_param": None}, "fp16": None,
         "bf16": None, "data_types": None, "aio": None}


@pytest.mark.quick
def test_null_and_missing_sections_read_alike():
    missing = {"zero_optimization": {"stage": 2}}
    for config in (NULLS, missing):
        assert ds.section(config, "zero_optimization", "offload_optimizer") == {}
        assert ds.offload_device(config, "offload_optimizer") == "none"
        assert ds.zero_stage(config) == 2
        assert not ds.fp16_enabled(config) and not ds.cpu_optimizer_forced(config)
        assert ds.nvme_folders(config) == []
    assert ds.Settings.from_config(NULLS) == ds.Settings.from_config(missing)
    assert ds.zero_stage({"zero_optimization": {"stage": "auto"}}) == 0 and ds.zero_stage({}) == 0
    offloaded = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
                                       "offload_param": {"device": "cpu"}}}
    assert (ds.offload_device(offloaded, "offload_optimizer"), ds.offload_device(offloaded, "offload_param")) == (
        "nvme", "cpu")
    assert ds.nvme_folders(offloaded) == ["/x"] and ds.cpu_optimizer_forced(offloaded)
    assert not ds.cpu_optimizer_forced({**offloaded, "zero_force_ds_cpu_optimizer": False})


def test_prepare_reads_null_sections_as_missing_ones(scenario):
    # "offload_optimizer": null raised AttributeError in the fix's prepare() before; a null offload_param trains as
    # plain accelerate does, and a null offload_optimizer reaches accelerate, whose own prepare() stops on it as
    # without the fix
    fixed = result(scenario("null_sections"))
    assert fixed == result(scenario("null_sections", "--reference"))
    assert len(fixed["losses"]) == 4 and fixed["losses"][-1] != fixed["losses"][0]
    for args in (["--null-optimizer-offload"], ["--null-optimizer-offload", "--reference"]):
        stderr = scenario("null_sections", *args, check=False).stderr
        frames = [line for line in stderr.splitlines() if line.strip().startswith(("File", "[rank0]:   File"))]
        assert "AttributeError: 'NoneType' object has no attribute 'get'" in stderr
        assert "accelerate/accelerator.py" in frames[-1] and "_prepare_deepspeed" in frames[-1], frames[-3:]
