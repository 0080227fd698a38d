"""Will a training fit this machine: the memory model, the check prepare() runs before DeepSpeed allocates, the
shipped tiers (configs/ is written from them), the per-tier advice that ``python -m accel_ds_fix plan`` prints,
and a model's hidden size (DeepSpeed's "auto" bucket sizes, which the merged module's config gives too).

May use: the ground, nvme (what that tier needs, how fast the disk is), weights (a partitioned parameter's size),
streaming (how the streaming tier cuts a model into blocks).
"""
