"""What NVMe offload needs from the machine, beyond memory: DeepSpeed's async_io op (which needs libaio), a swap
folder on a filesystem that takes direct I/O (O_DIRECT), and room on its disk for the swap files and for the
checkpoints the run saves. Checked by prepare() before anything is allocated, by `plan` and by the report, so
"cannot run here" is said up front instead of DeepSpeed's "Unable to JIT load the async_io op ... None"."""

import errno
import mmap
import os

from ..deepspeed_config import Settings, nvme_folders
from ..ops import builds, libaio
from ..units import size_in_words
from . import swap_folder

GIB = 1024**3
RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def existing_ancestor(path):
    """``path`` or the nearest folder above it that exists (where a folder not made yet would live)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(path):
    stats = os.statvfs(existing_ancestor(path))
    return stats.f_bavail * stats.f_frsize


def filesystem_of(path):
    """(mount point, filesystem type) of the filesystem holding ``path``, or None without /proc/mounts."""
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(existing_ancestor(path))
    mount = max((m for m in mounts if real == m[1] or real.startswith(m[1].rstrip("/") + "/")),
                key=lambda m: len(m[1]), default=None)
    return (mount[1], mount[2]) if mount else None


def async_io_problem(load=False):
    """None when DeepSpeed's async_io op can be used here, else why, in words. An op already built is loaded
    (a fraction of a second); one not built yet is only checked, unless ``load`` (then it compiles, as DeepSpeed
    itself would a moment later)."""
    libaio.activate()
    try:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        builder_class = accelerator.get_op_builder("AsyncIOBuilder")
    except Exception as exc:  # DeepSpeed missing or broken: that is the reason
        return f"DeepSpeed cannot be imported ({exc!r})"
    if builder_class is None or getattr(builder_class, "NAME", None) in (None, "deepspeed_not_implemented"):
        return f"DeepSpeed's {accelerator.device_name()} accelerator has no async_io op"
    builder = builder_class()
    if not builds.is_built(builder.NAME):
        if not builder.has_function("io_submit", ("aio",)):
            return f"libaio is missing, and DeepSpeed's async_io op cannot be built without it: {libaio.INSTALL_HINT}"
        if not builder.is_compatible(verbose=False):
            return f"DeepSpeed says its async_io op cannot be built on this machine ({builder.error_log})"
        if not load:
            return None
    try:
        builder.load(verbose=False)
    except Exception as exc:  # a compile or load error, in DeepSpeed's words
        if "libaio" in str(exc):  # built against a libaio that is gone (or was on paths this process lacks)
            return f"libaio is missing: DeepSpeed's async_io op needs it to load ({exc}): {libaio.INSTALL_HINT}"
        return f"DeepSpeed's async_io op does not load: {exc}"
    return None


def direct_io_problem(folder):
    """None when files in ``folder`` (or where it would be made) take direct I/O, else why."""
    where = existing_ancestor(folder)
    mount = filesystem_of(where)
    if mount and mount[1] in RAM_FILESYSTEMS:
        return (f"the NVMe folder {folder} is on {mount[1]} ({mount[0]}), which is host memory: the optimizer states "
                "would fill RAM after all. Set nvme_path to a folder on a disk")
    probe = os.path.join(where, f".accel_ds_fix_direct_io_{os.getpid()}")
    page = mmap.mmap(-1, mmap.PAGESIZE)  # page-aligned, as O_DIRECT wants
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            kind = f" ({mount[1]})" if mount else ""
            return (f"the filesystem of the NVMe folder {folder}{kind} does not take direct I/O (O_DIRECT), which "
                    "DeepSpeed's NVMe offload uses: set nvme_path to a folder on a local disk (ext4, xfs, btrfs)")
        return f"the NVMe folder {folder} cannot be written ({exc.strerror}: {where})"
    finally:
        page.close()
        if os.path.exists(probe):
            os.unlink(probe)
    return None


def locked_memory_problem(config, largest_sub_group=None):
    """None unless DeepSpeed would lock more host memory than this user may. On a CPU-only machine its NVMe swap
    locks its buffers with mlock (on a GPU machine CUDA pins them, outside that limit), and a failed mlock aborts
    the process (an assertion in deepspeed_pin_tensor.cpp), so this is said before."""
    import resource

    try:
        import torch

        if torch.cuda.is_available():
            return None
    except ImportError:
        pass
    if os.geteuid() == 0:  # root may lock any amount (CAP_IPC_LOCK)
        return None
    limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    settings = Settings.from_config(config)
    # buffer_count swap buffers, each the size of the largest sub group (sub_group_size where the models are not
    # known yet), and I/O bounce buffers
    largest = largest_sub_group if largest_sub_group is not None else settings.sub_group
    need = settings.swap_buffers * largest * 4 + 64 * 1024**2
    if limit == resource.RLIM_INFINITY or limit >= need:
        return None
    return (f"on a machine without a GPU DeepSpeed's NVMe swap locks about {need / GIB:.2f} GiB of host memory, and "
            f"this user may lock {limit / 1024**2:.0f} MiB (ulimit -l): raise the limit (a memlock line in "
            "/etc/security/limits.conf, then log in again), or run it on a GPU machine, where CUDA pins the buffers")


def problems(config, load=False, largest_sub_group=None):
    """Why a config that offloads to NVMe cannot run here ([] when it can, or when it uses no NVMe);
    ``largest_sub_group``: the elements of the largest optimizer sub group a process swaps, where the models are
    known (memory.model.largest_sub_group)."""
    folders = nvme_folders(config)
    if not folders:
        return []
    found = [async_io_problem(load), locked_memory_problem(config, largest_sub_group)]
    for folder in folders:
        found.append(direct_io_problem(folder) if folder else
                     "the config offloads to NVMe without an nvme_path: name a folder on a local disk")
    return [p for p in found if p]


def room_problems(config, swap_bytes, checkpoint_bytes, world_size=1):
    """(errors, warnings) about disk room: the swap files must fit; a checkpoint that would not fit beside them
    is said before the run, since each save_state of this tier writes that much (to the folder the script
    names, often on the same disk). Swap files that dead runs left in this run's process folders count as free:
    the run removes them first (swap_folder.take)."""
    errors, warnings = [], []
    for folder in nvme_folders(config):
        if not folder:
            continue
        free = free_bytes(folder) + sum(swap_folder.stale(folder, set(range(world_size))).values())
        if free < swap_bytes:
            errors.append(f"disk: the NVMe offload folder {folder} needs {size_in_words(swap_bytes)}, its disk has "
                          f"{size_in_words(free)} free")
        elif free < swap_bytes + checkpoint_bytes:
            warnings.append(
                f"the disk of {folder} has {size_in_words(free)} free: the swap files take {size_in_words(swap_bytes)} "
                f"and each save_state writes about {size_in_words(checkpoint_bytes)} (the fp32 master weights and Adam "
                "states), so a checkpoint on this disk will not fit: save it to another disk, or free space first")
    return errors, warnings
