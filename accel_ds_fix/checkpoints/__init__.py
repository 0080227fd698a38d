"""Checkpoints of merged engines: save_state / load_state (save_load), their crash safety (crash_safe), the
manifest written beside DeepSpeed's files, the load hooks run with the models (load_hooks), what a load needs in
host memory (load_memory), what ZeRO-3 + NVMe resume needs (nvme_resume), the optimizer's parameter groups and CPU
Adam's step kept across a load (param_groups, cpu_adam_steps), and resuming under another DeepSpeed layout
(layout/).

May use: the ground, processes, weights, nvme, memory (the host memory available), zero3, merge (the proxy, which
parameters DeepSpeed trains).
"""
