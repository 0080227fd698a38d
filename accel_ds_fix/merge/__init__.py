"""The merge: the wrapper of ``Accelerator.prepare`` that turns the models of one call into one module for one
DeepSpeed engine (merge_plan, merged_module, naming), and the proxy handed back in each model's place. With several
optimizers (GAN-style scripts) one engine per optimizer (optimizer_groups decides, engine_per_optimizer builds,
backward_routing sends each loss to the engine it trains).

May use the top-level modules, memory.check (run inside prepare() before anything is allocated) and patches.
"""
