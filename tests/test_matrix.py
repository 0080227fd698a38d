"""The core two-model test against older accelerate/DeepSpeed releases, each in its own venv (.venvs/<point>).

The newest point (accelerate 1.16 + DeepSpeed 0.19.8) is the suite's own .venv. accelerate before 0.29 runs
DeepSpeed only on CUDA/XPU devices (AcceleratorState calls torch.cuda.set_device), so those releases are
checked on a GPU by bench/old_accelerate.sh, not here. DeepSpeed before 0.14.4 does not import with torch 2.13
(torch.distributed.elastic lost `log` and `_get_socket_with_port`).
"""

import json
import os
import sys
import venv
from pathlib import Path

import pytest

from conftest import ROOT, clean_env, run
from old_releases import installed_alone

MATRIX = {
    # the oldest accelerate whose DeepSpeed path runs on a CPU, with the oldest DeepSpeed that imports here
    # (transformers 5 wants accelerate >= 1.1 for its DeepSpeed integration, which ZeRO-3 imports)
    "accelerate-0.29.0-deepspeed-0.14.4": ["accelerate==0.29.0", "deepspeed==0.14.4", "pydantic<2", "transformers==4.44.2"],
    # the last 0.x accelerate, with the newest DeepSpeed
    "accelerate-0.34.2-deepspeed-0.19.8": ["accelerate==0.34.2", "deepspeed==0.19.8", "transformers==4.44.2"],
    # the release before the main stack's (constraints.txt: accelerate 1.16.0)
    "accelerate-1.15.0-deepspeed-0.19.8": ["accelerate==1.15.0", "deepspeed==0.19.8", "transformers"],
}
CORE_TESTS = "zero2] or zero3] or zero2-cpu-offload] or without_fix"
# transformers < 4.51 refuses low_cpu_mem_usage under ZeRO-3 (the points with transformers 4.44 run this too)
LOADING_TEST = "low_cpu_mem_usage"


def link_torch(site_packages):
    """This suite's torch (the CPU build every venv here uses) and what it requires, hard-linked into another venv's
    site-packages with their metadata, so that pip finds it installed: unpacking the 200 MB wheel took most of a
    venv's minute, three times on a fresh clone. False where a link cannot be made (another file system)."""
    import importlib.metadata as metadata
    import re
    import shutil

    seen, todo = set(), ["torch"]
    while todo:
        name = re.split(r"[\s;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        # what the new venv has already (pip and setuptools from venv.create) stays its own: files of two releases
        # mixed in one folder break it
        folder_name = dist.metadata["Name"].replace("-", "_")
        if any(site_packages.glob(f"{folder_name}-*.dist-info")) or \
                any(site_packages.glob(f"{folder_name.lower()}-*.dist-info")):
            continue
        todo += [r for r in dist.requires or () if "extra ==" not in r]
        for file in dist.files or ():
            source = Path(dist.locate_file(file)).resolve()
            target = site_packages / file
            if not source.is_file() or not str(target.resolve()).startswith(str(site_packages)):
                continue  # scripts in bin/ and the like
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)
            except FileExistsError:
                pass
            except OSError:
                shutil.rmtree(site_packages / "torch", ignore_errors=True)
                return False
    return True


def make_venv(path, requirements):
    marker = path / ".installed"
    if marker.exists():
        return path / "bin" / "python"
    venv.create(path, with_pip=True, clear=True)
    py = path / "bin" / "python"
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    site_packages = next((path / "lib").glob("python3*/site-packages"))
    if not link_torch(site_packages):
        run([*pip, "torch==2.13.0"], timeout=900)  # the local CPU build, first
    run([*pip, "torch==2.13.0", "setuptools", "wheel"], timeout=900)  # already there: checked, not installed
    # DeepSpeed is an sdist whose setup.py imports torch: build it against this venv's torch.
    run([*pip, "--no-build-isolation", *requirements, "wrapt>=2", "ninja", "pytest"], timeout=900)
    run([*pip, "--no-deps", "--no-build-isolation", "-e", ROOT], timeout=300)
    marker.touch()
    return py


@pytest.mark.parametrize("point", MATRIX, ids=MATRIX)
def test_core_training_on_older_releases(point):
    """About 20 s each (2 minutes more the first time): a venv of its own per accelerate/DeepSpeed release (made
    once, then reused from .venvs/), and the training launched in it with and without the fix."""
    py = make_venv(ROOT / ".venvs" / point, MATRIX[point])
    accelerate, deepspeed = MATRIX[point][0].split("==")[1], MATRIX[point][1].split("==")[1]
    probe = "from importlib.metadata import version as v; print(v('accelerate'), v('deepspeed'))"
    found = run([py, "-c", probe])
    assert found.stdout.split() == [accelerate, deepspeed]
    # LOCAL_SIZE: DeepSpeed < 0.15's CPU accelerator otherwise counts NUMA nodes with the numactl program
    # under ZeRO-3; DeepSpeed's own launcher sets it, `python script.py` does not.
    env = clean_env(TORCH_EXTENSIONS_DIR=str(ROOT / ".venvs" / point / "torch_extensions"), LOCAL_SIZE="1")
    proc = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_training.py", "tests/test_merge_cases.py",
                "-k", f"{CORE_TESTS} or {LOADING_TEST}"], env=env, timeout=1200)
    old_transformers = "transformers==4.44.2" in MATRIX[point]
    expected = "5 passed" if old_transformers else "4 passed, 1 skipped"
    assert expected in proc.stdout, proc.stdout[-2000:]


# accelerate 0.15 (the pin of kohya's January 2023 scripts (bf691aef)) builds no Accelerator with DeepSpeed on a CPU; what it does with the
# shipped configs before that runs here with its real DeepSpeedPlugin (the GPU run: docs/gpu.md, run 7).
OLD_ACCELERATE_PROBE = """
import json, torch
from accelerate.utils import DeepSpeedPlugin
result = {}
try:
    DeepSpeedPlugin(hf_ds_config="configs/ds_zero2_offload.json")
except ValueError as e:
    result["without_fix"] = str(e)
import accel_ds_fix
from accel_ds_fix.launch import old_accelerate
config = DeepSpeedPlugin(hf_ds_config="configs/ds_zero2_offload.json").deepspeed_config
old_accelerate.fill_precision(config, "fp16")
model = torch.nn.Linear(2, 2)
swapped = old_accelerate.with_cpu_adam((model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)), config)
result.update(accumulation=config["gradient_accumulation_steps"], fp16=config["fp16"]["enabled"],
              bf16=config["bf16"]["enabled"], model_kept=swapped[0] is model, optimizer=type(swapped[1]).__name__,
              params_kept=[id(p) for p in swapped[1].param_groups[0]["params"]] == [id(p) for p in model.parameters()],
              lr=swapped[1].param_groups[0]["lr"], weight_decay=swapped[1].param_groups[0]["weight_decay"])
print(json.dumps(result))
"""


def test_accelerate_0_15_takes_the_shipped_configs_with_the_fix():
    target = installed_alone("accelerate==0.15.0", ROOT / ".venvs" / "accelerate-0.15.0-alone")
    proc = run([sys.executable, "-c", OLD_ACCELERATE_PROBE], env=clean_env(PYTHONPATH=str(target)))
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "without_fix": "gradient_accumulation_steps cannot be set to 'auto' in the DeepSpeed config.",
        "accumulation": 1, "fp16": True, "bf16": False, "model_kept": True, "optimizer": "DeepSpeedCPUAdam",
        "params_kept": True, "lr": 1e-3, "weight_decay": 0.01,
    }
