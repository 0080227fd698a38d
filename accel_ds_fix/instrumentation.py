"""install() / uninstall(): put the wrappers of patches.py on accelerate.Accelerator and take them off again.

accelerate may be imported before or after this package: a wrapt post-import hook applies the patches the
moment ``accelerate.accelerator`` is (or already was) imported.
"""

import sys
import threading

import wrapt

TARGET_MODULE = "accelerate.accelerator"

# attribute path inside accelerate.accelerator -> name of the wrapper in accel_ds_fix.patches
PATCHED_METHODS = {
    "Accelerator.prepare": "prepare",
    "Accelerator.unwrap_model": "unwrap_model",
    "Accelerator.get_state_dict": "get_state_dict",
    "Accelerator.register_save_state_pre_hook": "register_save_state_pre_hook",
    "Accelerator.save_state": "save_state",
    "Accelerator.load_state": "load_state",
    "Accelerator.clip_grad_norm_": "clip_grad_norm_",
}

_lock = threading.RLock()
_installed = False
_hook_registered = False
_originals = {}  # attribute path -> (owner, attribute, original object)


def is_installed():
    return _installed


def install():
    """Activate the fix. Idempotent; safe before accelerate is imported."""
    global _installed, _hook_registered
    with _lock:
        if _installed:
            return
        _installed = True
        if not _hook_registered:
            _hook_registered = True
            # Runs at once if accelerate.accelerator is already imported, else right after its import.
            wrapt.register_post_import_hook(_on_accelerate_import, TARGET_MODULE)
        elif TARGET_MODULE in sys.modules:
            _apply(sys.modules[TARGET_MODULE])


def uninstall():
    """Restore accelerate's own methods. Idempotent. Objects already prepared keep working."""
    global _installed
    with _lock:
        _installed = False
        for owner, attribute, original in _originals.values():
            setattr(owner, attribute, original)
        _originals.clear()


def _on_accelerate_import(module):
    with _lock:
        if _installed:  # wrapt cannot unregister a hook; an uninstalled one does nothing
            _apply(module)


def _apply(module):
    if _originals:
        return
    from . import patches, versions

    versions.warn_if_untested()
    for path, wrapper_name in PATCHED_METHODS.items():
        class_name, method = path.split(".")
        if not hasattr(getattr(module, class_name), method):
            continue  # older accelerate: e.g. no save/load hooks before 0.17, nothing to route
        owner, attribute, original = wrapt.resolve_path(module, path)
        _originals[path] = (owner, attribute, original)
        wrapt.wrap_function_wrapper(module, path, getattr(patches, wrapper_name))
