"""Train several models with one optimizer through accelerate + DeepSpeed.

Importing this package activates the fix (see ``install()``); ``ACCEL_DS_FIX=1`` in the environment does the
same in every Python process that imports accelerate or DeepSpeed, through the ``accel_ds_fix.pth`` file
installed with the package. ``python -m accel_ds_fix`` reports whether it is active; ``python -m accel_ds_fix
plan`` says which DeepSpeed config fits a machine.

The layout, from the ground up (docs/how-it-works.md draws it); each folder's ``__init__`` says what it may use:

- the ground: errors, notices, versions, units, lookup (the one record the fix keeps on each engine, Accelerator
  and ZeRO-3 optimizer, and where an Accelerator keeps what the fix needs) and deepspeed_config (the one reader of
  a DeepSpeed config). May use: the ground.
- processes/, launch/, ops/, streaming/; weights/, nvme/; memory/, zero3/; merge/; checkpoints/; cli/.
- the face: this file, __main__, pth_file and instrumentation (the wrappers' table, named by strings and imported
  when their targets are). May use: every part.
"""

from .instrumentation import install, is_installed, uninstall

__version__ = "0.2.0"
__all__ = ["install", "uninstall", "is_installed", "unwrap", "__version__"]


def unwrap(model):
    """The user's own model behind an object returned by a merged ``prepare()``; anything else unchanged."""
    from .merge.proxy import unwrap as _unwrap

    return _unwrap(model)


install()
