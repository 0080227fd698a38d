"""Will a training fit this machine: the memory model, the check prepare() runs before DeepSpeed allocates, the
shipped tiers (configs/ is written from them) and the per-tier advice that ``python -m accel_ds_fix plan`` prints.

May use the top-level modules, nvme (what that tier needs, how fast the disk is) and merge's model hidden size.
"""
