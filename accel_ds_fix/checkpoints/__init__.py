"""Checkpoints of merged engines: save_state / load_state (save_load), their crash safety (crash_safe), the
manifest written beside DeepSpeed's files, what ZeRO-3 + NVMe resume needs, resuming under another DeepSpeed
layout (layout_change, and universal_copy: DeepSpeed's universal checkpoint format written beside a checkpoint,
conversion_memory: whether the host has the memory to write it), and per-model weight exports.

May use the top-level modules, merge (the proxy, which parameters DeepSpeed trains) and memory.check (the host
memory available, ACCEL_DS_FIX_MEMORY_CHECK).
"""
