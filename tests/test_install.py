"""install()/uninstall() and the version check, in fresh interpreters (no DeepSpeed run needed)."""

import sys
import textwrap
from pathlib import Path

import pytest

from accel_ds_fix import versions
from conftest import clean_env, run

pytestmark = pytest.mark.quick  # no DeepSpeed engine: the quick loop runs it (scripts/test.sh --quick)


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
    # ZeRO-1/2's flattening step is wrapped too (merge/gpu_block_release.py), whichever of the two is imported first.
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


ACTIVE_AFTER_ACCELERATE = "import accelerate, sys; m = sys.modules.get('accel_ds_fix'); print(bool(m and m.is_installed()))"


@pytest.mark.parametrize("value, active", [("1", True), ("true", True), ("Yes", True), ("on", True),
                                           ("0", False), ("off", False), ("no", False), ("", False)])
def test_env_var_values(value, active):
    proc = run([sys.executable, "-c", ACTIVE_AFTER_ACCELERATE], env=clean_env(ACCEL_DS_FIX=value))
    assert proc.stdout.split()[-1] == str(active)
    assert "accel_ds_fix" not in proc.stderr


@pytest.mark.parametrize("value", ["garbage", "flase", "2"])
def test_unrecognised_env_var_warns_once_and_leaves_the_fix_off(value):
    # A child process (as `accelerate launch` starts) inherits the variable and stays quiet: said once.
    code = ACTIVE_AFTER_ACCELERATE + "; import subprocess; subprocess.run([sys.executable, '-c', 'pass'])"
    proc = run([sys.executable, "-c", code], env=clean_env(ACCEL_DS_FIX=value))
    assert proc.stdout.split()[-1] == "False"
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("accel_ds_fix:")]
    assert warnings == [
        f"accel_ds_fix: ACCEL_DS_FIX={value!r} is not understood, so the fix stays off. Use one of 1, true, yes, "
        "on to turn it on, or one of '', '0', 'false', 'no', 'off' (or unset) for off."
    ]


def test_env_var_activates_lazily_on_first_accelerate_import():
    # A process that never imports accelerate or DeepSpeed pays for nothing but reading the variable.
    out = python("""
        import sys
        print(sorted(m for m in ('accel_ds_fix', 'wrapt') if m in sys.modules))
        import accelerate
        print(sys.modules['accel_ds_fix'].is_installed())
    """, ACCEL_DS_FIX="1")
    assert out == ["[]", "True"]


def test_untested_version_warning_names_the_users_import_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import accel_ds_fix.versions as v\n"
        "v.SUPPORTED['accelerate'] = ('0.1.0', '0.2.0')  # pretend the installed release is untested\n"
        "import accelerate\n"
    )
    proc = run([sys.executable, script], env=clean_env())
    assert f"{script}:3: RuntimeWarning: accel_ds_fix is tested with accelerate 0.1.0 to 0.2.0" in proc.stderr


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


def test_report_says_whether_the_fix_is_active():
    off = run([sys.executable, "-m", "accel_ds_fix"], env=clean_env()).stdout
    on = run([sys.executable, "-m", "accel_ds_fix"], env=clean_env(ACCEL_DS_FIX="1")).stdout
    for out in (off, on):
        assert f"accelerate    {versions.installed_version('accelerate')}" in out
        assert "tested (tested 0.15.0 to 1.16.0)" in out
        assert "accel_ds_fix.pth:  /" in out and "DeepSpeed cpu_adam op:" in out
        assert "CUDA devices:" in out and "CPU threads:" in out
    assert "ACCEL_DS_FIX:      unset" in off and "fix active:        no: set ACCEL_DS_FIX=1" in off
    assert "ACCEL_DS_FIX:      '1': on" in on
    assert "fix active:        yes: a script started with this environment gets the fix" in on


def test_installed_stack_gives_no_version_warning():
    out = python("""
        import warnings
        warnings.simplefilter("error")
        import accelerate, accel_ds_fix
        print("quiet")
    """)
    assert out == ["quiet"]


def test_suffixed_cuda_architectures_build_with_the_fix():
    """TORCH_CUDA_ARCH_LIST=9.0a (CUDA images for Hopper) stops every DeepSpeed 0.19.8 op build with "invalid literal
    for int() with base 10: '0a'"; with the fix the build reads 9.0 and the variable stays as the user set it."""
    probe = [sys.executable, str(Path(__file__).resolve().parent / "arch_list_probe.py")]
    env = clean_env(TORCH_CUDA_ARCH_LIST="9.0a;10.0a+PTX")
    without = run(probe, env=env, check=False)
    assert without.returncode != 0 and "invalid literal for int() with base 10: '0a'" in without.stderr
    fixed = run([*probe, "--fix"], env=env)
    assert "DEEPSPEED SET 9.0;10.0+PTX" in fixed.stdout and "AFTER 9.0a;10.0a+PTX" in fixed.stdout
    assert ("TORCH_CUDA_ARCH_LIST='9.0a;10.0a+PTX' has architecture suffixes DeepSpeed cannot parse: its ops are "
            "built with '9.0;10.0+PTX'") in fixed.stderr
