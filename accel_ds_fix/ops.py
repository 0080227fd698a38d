"""Where DeepSpeed's JIT-compiled C++ ops (cpu_adam for optimizer offload, ...) live, and whether one is built."""

import os


def build_directory(name):
    """The folder torch.utils.cpp_extension builds (and caches) the op ``name`` in."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def prebuilt(name):
    """Whether the installed DeepSpeed was built with this op (DS_BUILD_OPS), so nothing is compiled."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return False
    return bool(installed_ops.get(name, False))


def is_built(name):
    return prebuilt(name) or os.path.exists(os.path.join(build_directory(name), f"{name}.so"))
