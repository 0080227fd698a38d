"""Where an Accelerator keeps what this package needs: its DeepSpeed config and the engine of merged models."""


def uses_deepspeed(accelerator):
    return getattr(accelerator.distributed_type, "value", accelerator.distributed_type) == "DEEPSPEED"


def deepspeed_config(accelerator):
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin.deepspeed_config if plugin else {}


def merged_engine(accelerator):
    """The DeepSpeed engine of this accelerator that holds merged models, or None."""
    return next((m for m in accelerator._models if getattr(m, "_accel_ds_fix_proxies", None)), None)


def merged_engines(accelerator):
    """Every DeepSpeed engine of this accelerator that holds merged models: one per optimizer of a GAN-style
    prepare() (merge/engine_per_optimizer.py), else at most one."""
    return [m for m in accelerator._models if getattr(m, "_accel_ds_fix_proxies", None)]


def engines_read_in_parts(accelerator):
    """The ZeRO-3 engines whose models a script reads one by one: the merged ones, and a wrapper of models the
    script calls itself (kohya's --deepspeed, patches/zero3_direct_calls.py)."""
    return [m for m in accelerator._models
            if getattr(m, "_accel_ds_fix_proxies", None) or getattr(m, "_accel_ds_fix_called_in_parts", False)]
