"""The merge: the wrapper of ``Accelerator.prepare`` that turns the models of one call into one module for one
DeepSpeed engine (merge_plan, merged_module, naming), and the proxy handed back in each model's place. With several
optimizers (GAN-style scripts) one engine per optimizer (optimizer_groups decides, engine_per_optimizer builds,
backward_routing sends each loss to the engine it trains). The step's own wrappers sit beside it: the script's
clip_grad_norm_ (clipping), spectral norm's dtype (spectral_norm_dtype), ZeRO-1/2's freed card blocks
(gpu_block_release), and a model's weights for export (exports: unwrap_model, get_state_dict).

May use: the ground, processes, launch, weights, memory (the check that prepare runs before anything is allocated),
zero3, streaming.
"""
