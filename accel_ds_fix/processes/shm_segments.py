"""Remove the name of DeepSpeed's CPU shared-memory segment as soon as every process has opened it.

On the CPU, DeepSpeed's TorchBackend (deepspeed/comm/torch.py) initializes its shm_comm op, whose C++
(csrc/cpu/comm/shm.cpp, shm_initialize) creates one POSIX shared-memory segment per process, named
``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (69 MB each, in /dev/shm, which is
RAM), then opens every other rank's segment, retrying until it exists. Nothing ever unlinks them: each CPU run
(and each killed one) left 69 MB per process in RAM until reboot. The op does this only when LOCAL_SIZE (set by
DeepSpeed's own launcher, or by hand) equals the world size (shm_interface.cpp).

Once every rank has mapped every segment the names are no longer needed (a mapping outlives its name), so right
after TorchBackend.__init__: one process unlinks its segment at once; several wait on a barrier of the group just
made (every rank has then opened all its peers' segments) and each unlinks its own. A failure here is logged at
DEBUG once and never stops training.

Not handled: DeepSpeed's oneCCL backend (CCLBackend), whose ccl op creates the same names again after
TorchBackend.__init__; it needs oneccl_bindings_for_pytorch, which this package is not tested with.
"""

import logging
import os

from .. import versions

logger = logging.getLogger(__name__)
_reported = False


def unlink_after_init(wrapped, instance, args, kwargs):
    """TorchBackend.__init__: the process group exists and the shm op has created and opened the segments."""
    result = wrapped(*args, **kwargs)
    try:
        if _segments_were_made(instance):
            _unlink_own_segment(instance)
    except Exception as error:  # the cleanup must never cost a training run
        _report_once(error)
    return result


def segment_name(rank, environ=os.environ):
    """The name shm.cpp gives ``rank``'s segment (snprintf "%s_%d_%s_%s" then "%s_%d"); unset variables are ""."""
    return (f"deepspeed_allreduce_buffer_{os.getuid()}_{environ.get('MASTER_ADDR', '')}_"
            f"{environ.get('MASTER_PORT', '')}_{rank}")


def _segments_were_made(backend):
    if getattr(backend, "shm_comm_op", None) is None:  # GPUs and other accelerators: no shm op
        return False
    if getattr(backend, "ccl_comm_op", None) is not None:  # oneCCL re-creates the names later: see the docstring
        return False
    if not versions.in_range("deepspeed", versions.DEEPSPEED_SHM_SEGMENT_NAMES):
        return False
    # shm_interface.cpp: segments only when every rank is on this machine, i.e. LOCAL_SIZE == world size (>= 1).
    local_size = os.environ.get("LOCAL_SIZE", "").strip()
    return local_size.isdigit() and int(local_size) == backend.get_world_size() >= 1


def _unlink_own_segment(backend):
    if backend.get_world_size() > 1:
        # Each rank left shm_initialize only after opening all its peers' segments: after this barrier no one
        # opens a name any more. Every rank got here alike (same shm op, same LOCAL_SIZE), so none waits alone.
        backend.barrier()
    unlink_segment(segment_name(backend.get_rank()))


def unlink_segment(name):
    """Remove shared-memory segment ``name``; one that is not there is not an error."""
    try:
        import _posixshmem  # CPython's shm_unlink (the same call multiprocessing.shared_memory makes)
    except ImportError:
        _posixshmem = None
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink("/" + name)
        else:
            os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


def _report_once(error):
    global _reported
    if not _reported:
        _reported = True
        logger.debug("could not remove DeepSpeed's shared-memory segment name (it stays in /dev/shm): %r", error)
