"""The NVMe tier: what it needs from the machine (async_io op, direct I/O, room, locked memory), how fast a step is
on a given disk, and the DeepSpeed patch that keeps the step's fp32 gradients in host memory.

May use the top-level modules, ops and memory.model (the swap buffers' sizes).
"""
