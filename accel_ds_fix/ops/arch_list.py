"""TORCH_CUDA_ARCH_LIST with architecture suffixes ("9.0a", as CUDA images for Hopper set it; "10.0a", "12.0f"),
which DeepSpeed 0.19.8's op builder cannot parse: every op build or load then fails with "invalid literal for
int() with base 10: '0a'", the NVMe tier's async_io and the CPU optimizer's cpu_adam among them.

While DeepSpeed builds or loads an op the suffix is dropped (9.0a -> 9.0, 10.0a+PTX -> 10.0+PTX): the ops the fix
uses are host code, built the same for 9.0 as for 9.0a. The variable is as it was afterwards, and the change is said
once."""

import contextlib
import logging
import os
import re

from .. import notices

VARIABLE = "TORCH_CUDA_ARCH_LIST"
_SUFFIXED = re.compile(r"^(\d+\.\d+)[a-z]+(\+PTX)?$")


def parseable(value):
    """``value`` with every suffixed entry in the form DeepSpeed parses; separators kept as DeepSpeed reads them."""
    entries = [e for e in re.split(r"[;\s]+", value.strip()) if e]
    return ";".join(_SUFFIXED.sub(r"\1\2", e) for e in entries)


@contextlib.contextmanager
def readable_by_deepspeed():
    value = os.environ.get(VARIABLE)
    if value is None or parseable(value) == ";".join(e for e in re.split(r"[;\s]+", value.strip()) if e):
        yield
        return
    fixed = parseable(value)
    notices.say(f"{VARIABLE}={value!r} has architecture suffixes DeepSpeed cannot parse: its ops are built with "
                f"{fixed!r} (the same host code; the variable is left as it is for everything else).",
                level=logging.INFO, once_key=VARIABLE)
    os.environ[VARIABLE] = fixed
    try:
        yield
    finally:
        os.environ[VARIABLE] = value
