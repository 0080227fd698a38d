"""Around DeepSpeed's OpBuilder.jit_load: say when it compiles one of its C++ ops for the first time (a silent
`prepare()` of several minutes, cpu_adam for optimizer offload on 2 cores, looks like a hang), and give it the
environment it needs (libaio's paths, a TORCH_CUDA_ARCH_LIST it can parse)."""

import logging
import os
import time

from .. import notices
from . import arch_list, builds, libaio


def announce_first_build(wrapped, instance, args, kwargs):
    """OpBuilder.jit_load: compiles the op unless torch's extension cache already holds it."""
    name = getattr(instance, "name", None)
    if name == "async_io":
        libaio.activate()  # before DeepSpeed's compatibility check, the compile and the load
    if name and not builds.is_built(name) and builds.clear_stale_lock(name):
        notices.say(f"removed the lock of a {name} build that was killed halfway: building it again.",
                    level=logging.WARNING)
    announce = (bool(name) and os.environ.get("LOCAL_RANK", "0") == "0" and not builds.building_ahead()
                and not builds.is_built(name))
    if announce:
        notices.say(
            f"DeepSpeed is compiling its {name} op for the first time: this takes a few minutes, once; later "
            f"runs load it from {builds.build_directory(name)}.",
            level=logging.WARNING,
        )
    started = time.monotonic()
    with arch_list.readable_by_deepspeed():  # TORCH_CUDA_ARCH_LIST=9.0a: an error in every build and load
        result = wrapped(*args, **kwargs)
    if announce:
        notices.say(f"DeepSpeed's {name} op was built in {time.monotonic() - started:.0f} s.", level=logging.WARNING)
    return result
