"""install()/uninstall() and the version check, in fresh interpreters (no DeepSpeed run needed)."""

import sys
import textwrap

import pytest

from accel_ds_fix import versions
from conftest import clean_env, run


def python(code, **env):
    proc = run([sys.executable, "-c", textwrap.dedent(code)], env=clean_env(**env))
    return proc.stdout.split()


def test_import_after_accelerate_patches_prepare():
    out = python("""
        import accelerate, wrapt
        import accel_ds_fix
        print(isinstance(accelerate.Accelerator.__dict__["prepare"], wrapt.FunctionWrapper), accel_ds_fix.is_installed())
    """)
    assert out == ["True", "True"]


def test_import_before_accelerate_patches_prepare():
    out = python("""
        import accel_ds_fix, wrapt
        import accelerate
        print(isinstance(accelerate.Accelerator.__dict__["prepare"], wrapt.FunctionWrapper))
    """)
    assert out == ["True"]


def test_install_and_uninstall_are_idempotent_and_reversible():
    out = python("""
        import accelerate, wrapt
        original = accelerate.accelerator.Accelerator.__dict__["prepare"]
        import accel_ds_fix
        accel_ds_fix.install(); accel_ds_fix.install()
        wrapped = accelerate.Accelerator.__dict__["prepare"]
        print(wrapped.__wrapped__ is original)         # wrapped once, not twice
        accel_ds_fix.uninstall(); accel_ds_fix.uninstall()
        print(accelerate.Accelerator.__dict__["prepare"] is original, accel_ds_fix.is_installed())
        accel_ds_fix.install()
        print(accelerate.Accelerator.__dict__["prepare"].__wrapped__ is original)
    """)
    assert out == ["True", "True", "False", "True"]


def test_deepspeed_zero_hook_follows_install_and_uninstall():
    # ZeRO-1/2's flattening step is wrapped too (zero_memory.py), whichever of the two is imported first.
    out = python("""
        import accel_ds_fix, wrapt
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Z
        method = lambda: Z.__dict__["_update_model_bit16_weights"]
        print(isinstance(method(), wrapt.FunctionWrapper))
        original = method().__wrapped__
        accel_ds_fix.uninstall()
        print(method() is original)
        accel_ds_fix.install(); accel_ds_fix.install()
        print(method().__wrapped__ is original)
    """)
    assert out[-3:] == ["True", "True", "True"]  # DeepSpeed logs its accelerator to stdout first


def test_uninstall_before_accelerate_import_leaves_it_alone():
    out = python("""
        import accel_ds_fix
        accel_ds_fix.uninstall()
        import accelerate, wrapt
        print(isinstance(accelerate.Accelerator.__dict__["prepare"], wrapt.FunctionWrapper))
        accel_ds_fix.install()
        print(isinstance(accelerate.Accelerator.__dict__["prepare"], wrapt.FunctionWrapper))
    """)
    assert out == ["False", "True"]


def test_env_var_unset_imports_nothing_at_startup():
    # The .pth runs in every interpreter; without ACCEL_DS_FIX it must not even import this package.
    out = python("import sys; print(sorted(m for m in ('accel_ds_fix', 'wrapt', 'torch') if m in sys.modules))")
    assert out == ["[]"]


@pytest.mark.parametrize("value, active", [("1", True), ("true", True), ("0", False), ("off", False), ("", False)])
def test_env_var_values(value, active):
    out = python("import sys; print('accel_ds_fix' in sys.modules)", ACCEL_DS_FIX=value)
    assert out == [str(active)]


def test_untested_versions_are_named_with_the_fix():
    low, high = versions.SUPPORTED["accelerate"]
    assert versions.untested("accelerate", low) is None
    assert versions.untested("accelerate", high) is None
    assert versions.untested("accelerate", "0.27.2") is None
    message = versions.untested("accelerate", "99.0.0")
    assert f"tested with accelerate {low} to {high}, but 99.0.0 is installed" in message
    assert f"pip install 'accelerate>={low},<={high}'" in message
    assert versions.untested("accelerate", "0.14.9") is not None
    assert versions.untested("deepspeed", "0.19.8+cpu") is None


def test_old_accelerate_on_cpu_is_explained():
    assert versions.cpu_limit("0.28.0", cuda_available=True) is None
    assert versions.cpu_limit("0.29.0", cuda_available=False) is None
    message = versions.cpu_limit("0.19.1", cuda_available=False)
    assert "accelerate 0.19.1 runs DeepSpeed on CUDA devices only" in message
    assert "use accelerate >= 0.29.0" in message


def test_installed_stack_gives_no_version_warning():
    out = python("""
        import warnings
        warnings.simplefilter("error")
        import accelerate, accel_ds_fix
        print("quiet")
    """)
    assert out == ["quiet"]
