"""`python -m accel_ds_fix`: is the fix active where a training script would run, and does this machine have
what it needs (tested versions, DeepSpeed's CPU Adam op, CUDA devices, CPU threads)."""

import contextlib
import glob
import os
import site
import subprocess
import sys

from .. import __version__, pth_file, versions
from ..launch import cpu_threads
from ..ops import builds

# What a fresh interpreter with this environment says once it has imported accelerate.
_PROBE = "import accelerate, sys; m = sys.modules.get('accel_ds_fix'); print(bool(m and m.is_installed()))"
OTHER_PACKAGES = ("torch", "transformers", "diffusers", "peft", "bitsandbytes", "wrapt")


def _pth_files():
    folders = list(site.getsitepackages()) + [site.getusersitepackages()]
    return sorted({f for d in folders for f in glob.glob(os.path.join(d, "accel_ds_fix.pth"))})


def _env_value():
    value = os.environ.get("ACCEL_DS_FIX")
    if value is None:
        return "unset (the fix is off unless the script imports accel_ds_fix)"
    normalized = value.strip().lower()
    if normalized in pth_file.ON:
        return f"{value!r}: on"
    if normalized in pth_file.OFF:
        return f"{value!r}: off"
    return f"{value!r}: not understood, so off (use {'/'.join(pth_file.ON)} or {'/'.join(pth_file.OFF[1:])})"


def _fresh_process_active():
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"could not check ({exc})"
    if proc.returncode != 0:
        return "could not check: importing accelerate failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    if proc.stdout.strip().endswith("True"):
        return "yes: a script started with this environment gets the fix when it imports accelerate"
    return "no: set ACCEL_DS_FIX=1 (or import accel_ds_fix in the script)"


def _cuda_lines():
    try:
        import torch
    except ImportError:
        return ["torch is not installed"]
    if not torch.cuda.is_available():
        return ["none (DeepSpeed runs on the CPU here; fp16 needs a GPU, use bf16 or fp32)"]
    lines = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"cuda:{i} {props.name}, {props.total_memory / 2**30:.1f} GiB")
    return lines


def _cpu_adam_line():
    try:
        built = builds.is_built("cpu_adam")
        where = builds.location("cpu_adam")
    except Exception as exc:  # DeepSpeed or torch missing or broken: say so, the report goes on
        return f"unknown ({exc!r})"
    if built:
        return f"built ({where})"
    return (f"not built yet: the first run with optimizer offload compiles it for a few minutes, into {where} "
            f"(or build it now: python -m accel_ds_fix build-ops)")


def _tier_lines():
    """Whether each shipped tier has what it needs on this machine (memory aside: `plan` judges that)."""
    from ..memory import tiers
    from ..nvme import prerequisites as nvme_prerequisites

    out = []
    for tier in tiers.TIERS:
        try:
            with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout as it is imported
                problems = nvme_prerequisites.problems(tier.deepspeed_config())
        except Exception as exc:  # the report goes on whatever breaks
            problems = [f"could not check ({exc!r})"]
        verdict = f"cannot run here: {'; '.join(problems)}" if problems else "can run here (memory: see `plan`)"
        out.append(f"{tier.name:<14} {verdict}")
    return out


def lines():
    out = [f"accel_ds_fix {__version__} ({os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})", "", "versions:"]
    for package, (low, high) in versions.SUPPORTED.items():
        found = versions.installed_version(package)
        verdict = "not installed" if found is None else (versions.untested(package, found) and "UNTESTED" or "tested")
        out.append(f"  {package:<13} {found or '-':<12} {verdict} (tested {low} to {high})")
    for package in OTHER_PACKAGES:
        found = versions.installed_version(package)
        needed = " (MISSING: accelerate's DeepSpeed path imports it in every run: pip install transformers)" if (
            package == "transformers" and found is None) else ""
        out.append(f"  {package:<13} {found or '-'}{needed}")
    pth = _pth_files()
    out += [
        "",
        f"accel_ds_fix.pth:  {', '.join(pth) if pth else 'not installed (pip install the package; ACCEL_DS_FIX needs it)'}",
        f"ACCEL_DS_FIX:      {_env_value()}",
        f"fix active:        {_fresh_process_active()}",
        f"DeepSpeed cpu_adam op: {_cpu_adam_line()}",
        "CUDA devices:      " + "; ".join(_cuda_lines()),
        "shipped tiers:",
    ]
    out += [f"  {line}" for line in _tier_lines()]
    import torch

    cores = cpu_threads.cores_per_process()
    out.append(
        f"CPU threads:       {torch.get_num_threads()} torch threads, {cores} cores for this process, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} (torchrun sets it to 1 for several "
        f"processes unless it is set)"
    )
    return out
