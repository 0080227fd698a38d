"""install() / uninstall(): put the wrappers on accelerate (and one on DeepSpeed) and take them off again.

accelerate and DeepSpeed may be imported before or after this package: a wrapt post-import hook applies the
patches the moment each target module is (or already was) imported.
"""

import importlib
import sys
import threading

import wrapt

# module -> {attribute path inside it: "wrapper module.wrapper name" inside accel_ds_fix}
PATCHES = {
    "accelerate.accelerator": {
        "Accelerator.prepare": "patches.prepare",
        "Accelerator.unwrap_model": "patches.unwrap_model",
        "Accelerator.get_state_dict": "patches.get_state_dict",
        "Accelerator.register_save_state_pre_hook": "patches.register_save_state_pre_hook",
        "Accelerator.save_state": "patches.save_state",
        "Accelerator.load_state": "patches.load_state",
        "Accelerator.clip_grad_norm_": "patches.clip_grad_norm_",
    },
    "deepspeed.runtime.zero.stage_1_and_2": {
        "DeepSpeedZeroOptimizer._update_model_bit16_weights": "zero_memory.release_after_flatten",
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
    """Restore the original methods. Idempotent. Objects already prepared keep working."""
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


def _apply(module):
    target = module.__name__
    if any(key[0] == target for key in _originals):
        return
    if target == "accelerate.accelerator":
        from . import versions

        versions.warn_if_untested()
    for path, wrapper in PATCHES[target].items():
        class_name, method = path.split(".")
        if not hasattr(getattr(module, class_name, None), method):
            continue  # e.g. accelerate < 0.17 has no save/load hooks; another DeepSpeed may lack the ZeRO method
        owner, attribute, original = wrapt.resolve_path(module, path)
        _originals[(target, path)] = (owner, attribute, original)
        wrapper_module, wrapper_name = wrapper.split(".")
        function = getattr(importlib.import_module(f"{__package__}.{wrapper_module}"), wrapper_name)
        wrapt.wrap_function_wrapper(module, path, function)
