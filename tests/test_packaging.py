"""`pip install .` and `pip install -e .` both ship accel_ds_fix.pth, so ACCEL_DS_FIX=1 activates the fix."""

import re
import subprocess
import sys
import venv

import pytest

from conftest import ROOT, clean_env, run

pytestmark = pytest.mark.quick  # no DeepSpeed engine: the quick loop runs it (scripts/test.sh --quick)

# The .pth activates the fix when accelerate is first imported (this venv has no accelerate: the import fails
# after the fix has been imported, which is all this needs).
PROBE = """
import sys

try:
    import accelerate
except ImportError:
    pass
m = sys.modules.get('accel_ds_fix')
print(m is not None and m.is_installed())
"""


@pytest.mark.parametrize("editable", [False, True], ids=["wheel", "editable"])
def test_pip_install_activates_through_env_var(tmp_path, editable):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    target = ["-e", ROOT] if editable else [ROOT]
    # --no-deps: the .pth only needs wrapt to activate; torch/accelerate stay out of this throwaway venv.
    run([py, "-m", "pip", "install", "-q", "--no-deps", "wrapt", *target], env=clean_env())
    assert len(list((env_dir / "lib").glob("python*/site-packages/accel_ds_fix.pth"))) == 1
    assert run([py, "-c", PROBE], env=clean_env(ACCEL_DS_FIX="1")).stdout.split() == ["True"]
    assert run([py, "-c", PROBE], env=clean_env()).stdout.split() == ["False"]
    run([py, "-m", "pip", "uninstall", "-q", "-y", "accel_ds_fix"], env=clean_env())
    assert not list((env_dir / "lib").glob("python*/site-packages/accel_ds_fix.pth"))  # RECORD lists it


def test_broken_activation_is_reported_not_raised(tmp_path):
    # A .pth failure must never stop the interpreter: point the package import at a broken copy.
    broken = tmp_path / "accel_ds_fix"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('boom')\n")
    env = clean_env(ACCEL_DS_FIX="1", PYTHONPATH=str(tmp_path))
    code = "try:\n    import accelerate\nexcept ImportError:\n    pass\nprint('alive')"
    # cwd: not the checkout, whose own accel_ds_fix would be found first (activation happens after start-up)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "alive"
    assert "accel_ds_fix: ACCEL_DS_FIX is set, but the fix could not be activated: RuntimeError('boom')" in proc.stderr


def test_what_a_deepspeed_run_needs_is_declared():
    # accelerate 1.16 looks up transformers' version in every DeepSpeed run (DeepSpeedPlugin.set_deepspeed_weakref):
    # a venv holding only the declared packages died there with PackageNotFoundError before it was declared.
    from importlib import metadata

    declared = {re.split(r"[ <>=!;\[]", r)[0].lower() for r in metadata.requires("accel_ds_fix") if "extra ==" not in r}
    assert {"wrapt", "accelerate", "deepspeed", "torch", "transformers"} <= declared
