"""Full tensors from the parameters DeepSpeed partitioned or flattened: what a parameter is now (partitioned), the
state_dict hook that gives each merged model its own full, separate weights (full_weights), and the copies that let
the main process read ZeRO-3 weights alone with several processes (read_alone).

May use: the ground, processes.
"""
