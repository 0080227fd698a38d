"""The NVMe tier: what it needs from the machine (async_io op, direct I/O, room, locked memory), how fast a step is
on a given disk, and the DeepSpeed patches of its step: the fp32 gradients kept in host memory, the last sub groups
kept in host memory within the config's budget, and each sub group let go of once the pipelined swapper has
written it out.

May use: the ground, ops.
"""
