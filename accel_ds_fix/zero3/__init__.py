"""ZeRO-3 around the models: a move to the card before prepare() held back (held_moves) and the models
partitioned from host memory one weight at a time (host_partition) in the training precision (dtypes); models
loaded but never prepared made whole (unprepared, first_forward); transformers' loading with low_cpu_mem_usage and
a model loaded by one process at a time (loading); a prepared model's parts called directly (direct_calls); a
forward on one process alone named, not waited on (forward_alone).

May use: the ground, processes, weights.
"""
