"""install() / uninstall(): put the wrappers on accelerate and DeepSpeed and take them off again.

accelerate and DeepSpeed may be imported before or after this package: a wrapt post-import hook applies the
patches the moment each target module is (or already was) imported.
"""

import importlib
import sys
import threading

import wrapt

# module -> {attribute path inside it ("function" or "Class.method"): "wrapper module (in this package).wrapper name",
# or a tuple of them, innermost first}
PATCHES = {
    "accelerate.accelerator": {
        "Accelerator.__init__": "zero3.held_moves.arm_at_init",
        "Accelerator.prepare": "merge.prepare.prepare",
        "Accelerator.backward": ("merge.script_clipping.hold_step", "merge.trainability.backward",
                                 "processes.deferred_save.after_backward"),
        "Accelerator.accumulate": "merge.backward_routing.accumulate",
        "Accelerator.clip_grad_norm_": "merge.clipping.clip_grad_norm_",
        "Accelerator.unwrap_model": "merge.exports.unwrap_model",
        "Accelerator.get_state_dict": "merge.exports.get_state_dict",
        "Accelerator.save_state": ("checkpoints.save_load.save_state", "merge.script_clipping.step_first"),
        "Accelerator.load_state": "checkpoints.save_load.load_state",
        "Accelerator.end_training": ("processes.end_training.end_training", "processes.deferred_save.before_end"),
        "Accelerator.wait_for_everyone": ("weights.read_alone.snapshot_at_barrier",
                                          "processes.deferred_save.before_barrier"),
    },
    # optimizer offload: no import of bitsandbytes only to learn that the optimizer is not one of its classes
    "accelerate.utils.deepspeed": {
        "is_bnb_available": "launch.bnb_probe.only_if_imported",
    },
    # `accelerate launch` (the launcher process): a relative deepspeed_config_file of a YAML config
    "accelerate.commands.launch": {
        "_validate_launch_command": "launch.launch_config.resolve_config_file_paths",
    },
    # every process that builds a DeepSpeedPlugin: a config file that is not there
    "accelerate.utils.dataclasses": {
        "DeepSpeedPlugin.__post_init__": "launch.launch_config.check_config_file",
    },
    # ZeRO-3: transformers < 4.51 refuses low_cpu_mem_usage=True, which diffusers' loaders pass; a model loaded
    # partitioned and used without prepare() (Flux's frozen T5) is made whole
    "transformers.modeling_utils": {
        "PreTrainedModel.from_pretrained": ("zero3.loading.drop_low_cpu_mem_usage",
                                            "zero3.unprepared.watch_loaded"),
    },
    # ZeRO-3: a diffusers/transformers model's .to(card) before prepare() is held, to be partitioned from host memory
    # and, under the streaming tier, a cast or move after prepare() of a model whose frozen weights stream ends it
    "torch.nn.modules.module": {
        "Module.to": "zero3.held_moves.hold_back",
        "Module._apply": "streaming.hooks.end_streaming_on_change",
    },
    # DeepSpeed's CPU ops ask py-cpuinfo three times a launch, each a subprocess: once is enough
    "cpuinfo": {
        "get_cpu_info": "launch.cpu_info_once.once",
    },
    # CPU: the shared-memory segment each process makes in /dev/shm, unlinked once every rank has opened it
    "deepspeed.comm.torch": {
        "TorchBackend.__init__": "processes.shm_segments.unlink_after_init",
    },
    "deepspeed.runtime.zero.stage_1_and_2": {
        "DeepSpeedZeroOptimizer._update_model_bit16_weights": "merge.gpu_block_release.release_after_flatten",
    },
    # ZeRO-3 NVMe optimizer offload: the step's gradients from host memory, not a write and read on the disk
    "deepspeed.runtime.zero.stage3": {
        "DeepSpeedZeroOptimizer_Stage3._offload_grad_partition_at_boundary": "nvme.host_gradients.keep_on_host",
        "DeepSpeedZeroOptimizer_Stage3._swap_out_offload_fp32_gradients": "nvme.host_gradients.hand_to_swapper",
        # and the last sub groups within the config's host-memory budget kept off the disk
        "DeepSpeedZeroOptimizer_Stage3._swappable_optimizer_subgroup": "nvme.sub_groups_in_ram.swappable",
    },
    "deepspeed.runtime.engine": {
        "DeepSpeedEngine._configure_zero_optimizer": "nvme.sub_groups_in_ram.while_building",
        # streaming: a checkpoint's frozen weights from their host copies
        "DeepSpeedEngine._get_param_fragment_func": "streaming.hooks.host_copy_in_checkpoint",
        "DeepSpeedEngine.load_module_state_dict": "streaming.hooks.load_into_host_copies",
    },
    # ZeRO-3 NVMe optimizer offload, pipelined: a sub group's host tensors released once its write is submitted
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper": {
        "PipelinedOptimizerSwapper.swap_out_optimizer_state": "nvme.pipelined_swap.release_after_swap_out",
    },
    # NVMe offload: DeepSpeed loads its pin_memory op into the global symbol scope
    "deepspeed.ops.op_builder.pin_memory": {
        "PinMemoryBuilder.load": "ops.symbol_scope.libstdcxx_first",
    },
    "deepspeed.ops.op_builder.builder": {
        "OpBuilder.jit_load": "ops.first_build_notice.announce_first_build",
    },
}

_lock = threading.RLock()
_installed = False
_hooks_registered = False
_originals = {}  # (module, attribute path) -> (owner, attribute, original object)


def is_installed():
    return _installed


def install():
    """Activate the fix. Idempotent; safe before accelerate or DeepSpeed is imported."""
    global _installed, _hooks_registered
    with _lock:
        if _installed:
            return
        _installed = True
        for target in PATCHES:
            if not _hooks_registered:
                # Runs at once if the module is already imported, else right after its import.
                wrapt.register_post_import_hook(_on_import, target)
            elif target in sys.modules:
                _apply(sys.modules[target])
        _hooks_registered = True


def uninstall():
    """Restore the original functions. Idempotent. Objects already prepared keep working."""
    global _installed
    with _lock:
        _installed = False
        for owner, attribute, original in _originals.values():
            setattr(owner, attribute, original)
        _originals.clear()


def _on_import(module):
    with _lock:
        if _installed:  # wrapt cannot unregister a hook; an uninstalled one does nothing
            _apply(module)


def _exists(module, path):
    owner = module
    for part in path.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return False
    return True


def _apply(module):
    target = module.__name__
    if any(key[0] == target for key in _originals):
        return
    if target == "accelerate.accelerator":
        from . import versions

        versions.warn_if_untested()
    for path, wrappers in PATCHES[target].items():
        if not _exists(module, path):
            continue  # another release may lack it (accelerate < 0.17 has no save hooks, say): nothing to wrap
        owner, attribute, original = wrapt.resolve_path(module, path)
        _originals[(target, path)] = (owner, attribute, original)
        for wrapper in (wrappers,) if isinstance(wrappers, str) else wrappers:
            wrapper_module, wrapper_name = wrapper.rsplit(".", 1)
            function = getattr(importlib.import_module(f"{__package__}.{wrapper_module}"), wrapper_name)
            wrapt.wrap_function_wrapper(module, path, function)
