"""Old releases of single packages, installed alone into a folder (pip --target, no dependencies) once and put
before the suite's own packages through PYTHONPATH or sys.path by the test that needs them."""

import sys

from conftest import run


def installed_alone(requirement, target):
    """``target`` holding ``requirement`` alone, installed there on the first call."""
    if not (target / ".installed").exists():
        run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, requirement], timeout=300)
        (target / ".installed").touch()
    return target
