"""The streaming tier: what trains is the DeepSpeed engine's (ZeRO-2), and frozen weights beyond the card's budget
stay in pinned host memory, copied to the card block by block ahead of each use on a side stream, never copied
back. A LoRA's base bigger than the card then costs the copies that the computation does not hide.

- blocks: which modules are blocks (the children of a model's outermost lists, a large one cut at its inner lists),
  from the weights' names as `plan` reads them, and which of them stream
- host_memory: pinned host memory carved from whole chunks (torch's pinned allocator rounds each request up to a
  power of two: a 75 MB weight would hold 128 MB)
- streamer: one per process; loads a block, prefetches the next one along the order the last step used, releases
- hooks: when a block is needed (forward, gradient checkpointing's recomputation, backward) and when it is done;
  state_dict, load_state_dict and .to() of a model with streamed weights
- engine_build: prepare()'s part: the split, the host copies, the engine built without the streamed weights
- copy_speed: the card's copy bandwidth from pinned memory, which `plan` measures for the tier's step

May use: the ground.
"""
