"""ZeRO-3 NVMe optimizer offload with DeepSpeed's pipelined swapper: a swapped-out sub group's tensors let go.

The shipped NVMe tier overlaps the disk with the step (``pipeline_read`` / ``pipeline_write``): while one sub
group's Adam step runs, the next one is read and the previous one written. DeepSpeed 0.19.8's pipelined swapper
never releases a sub group's host tensors after writing it out (its partitioned swapper does). After the first
step that keeps Adam's two fp32 states of every sub group in host memory, 8 bytes a trained parameter (measured:
+2.75 GiB at 302M parameters on the CPU; for SD1.5 on the GPU machine, `pipeline_read` with 8 buffers took 17.2
GiB of host memory against 8.7 one sub group at a time: 7.3 GiB of it these states, the rest 4 more buffers).
After the write is submitted the states live in the swapper's pinned buffers, which it holds until the write
completes; the tensors are released as the partitioned swapper releases them. Applied to the DeepSpeed releases
in ``versions.PIPELINED_SWAP_RELEASE`` only.
"""

from .. import versions


def release_after_swap_out(wrapped, instance, args, kwargs):
    """PipelinedOptimizerSwapper.swap_out_optimizer_state: after the sub group's write is submitted, its master
    weights and Adam states (the optimizer's own tensors, first-step copies included) point at nothing, as the
    partitioned swapper leaves them; the next swap-in points them at buffers again."""
    from deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper import SYNC_SWAP_IN

    swap_in = instance.swap_ops.get(SYNC_SWAP_IN)
    result = wrapped(*args, **kwargs)
    if swap_in is not None and versions.in_range("deepspeed", versions.PIPELINED_SWAP_RELEASE):
        swap_in.param_info.release_memory()
    return result
