"""A checkpoint resumed under another DeepSpeed layout (ZeRO stage, processes, offload): the layout a checkpoint
and an engine have and whether the conversion can be done (change), DeepSpeed's universal checkpoint written
beside a checkpoint (universal_copy), and whether the host has the memory to write it (conversion_memory).

Part of checkpoints: May use: the ground, processes, weights, nvme, memory, zero3, merge, checkpoints.
"""
