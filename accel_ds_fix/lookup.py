"""Where an Accelerator and its engines keep what this package needs: the one record the fix attaches to each
object it annotates (a DeepSpeed engine it built or watches, an Accelerator, ZeRO-3's optimizer), the DeepSpeed
config, and the engines of merged models.

Each record is attached once under one attribute, and every part reads and writes it through ``engine_record``,
``accelerator_record`` and ``optimizer_record``, so each field is declared once, here, with its default and who
fills it. A user's model gets none: a script may pickle it whole (torch.save(model)), which must load where this
package is not installed; weights/full_weights.py leaves a plain flag on it.
"""

import dataclasses

_ATTRIBUTE = "_accel_ds_fix"
NOT_RECORDED = object()


@dataclasses.dataclass(eq=False)
class EngineRecord:
    # merged models: {name: proxy} (merge/engine_setup.py); None for an engine that holds no merged models
    proxies: dict = None
    # a wrapper of models that the script calls, and saves, one by one (kohya's --deepspeed: zero3/direct_calls.py)
    called_in_parts: bool = False
    # what was trainable and stepped when the engine was built, and what has been said of changes since
    # (merge/trainability.py)
    params: list = None
    flags: tuple = None
    trained: set = None
    stepped: set = None
    in_optimizer: set = None  # ids of what the script's optimizer held (None: not known)
    trainability_said: bool = False
    harmless_said: bool = False
    # one engine per optimizer (merge/engine_per_optimizer.py, merge/backward_routing.py): how messages name it,
    # the parameters it owns, why another engine's loss left it without gradients, accelerate's wrapper of it
    label: str = None
    owned: set = None
    dropped: str = None
    wrapper: object = None
    # the script's clip_grad_norm_ (merge/script_clipping.py): DeepSpeed's own step, whether accelerate's backward
    # is running (its step is then held), and the step held
    real_step: object = None
    holding_step: bool = False
    step_pending: tuple = None


@dataclasses.dataclass(eq=False)
class AcceleratorRecord:
    # the engines of a several-optimizer prepare() (merge/backward_routing.py), and the models of each
    # accelerator.accumulate() being run
    engines: list = dataclasses.field(default_factory=list)
    accumulating: list = dataclasses.field(default_factory=list)
    # what the DeepSpeed config said of gradient_clipping before accelerate filled in "auto" (merge/clipping.py)
    clipping_as_configured: object = NOT_RECORDED
    clip_said: bool = False


@dataclasses.dataclass(eq=False)
class OptimizerRecord:
    # the NVMe tier: the indices of the sub groups kept in host memory (nvme/sub_groups_in_ram.py)
    sub_groups_in_ram: list = None


def _record(obj, kind, create):
    holder = getattr(obj, "__dict__", None)  # an nn.Module keeps plain attributes in its __dict__ as well
    if holder is None:
        return None
    record = holder.get(_ATTRIBUTE)
    if record is None and create:
        record = holder[_ATTRIBUTE] = kind()
    return record if isinstance(record, kind) else None


def engine_record(engine, create=True):
    """The engine's record, made on first use; None where ``create`` is false and it has none."""
    return _record(engine, EngineRecord, create)


def accelerator_record(accelerator, create=True):
    """The Accelerator's record, made on first use; None where ``create`` is false and it has none."""
    return _record(accelerator, AcceleratorRecord, create)


def optimizer_record(optimizer, create=True):
    return _record(optimizer, OptimizerRecord, create)


def uses_deepspeed(accelerator):
    return getattr(accelerator.distributed_type, "value", accelerator.distributed_type) == "DEEPSPEED"


def deepspeed_config(accelerator):
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin.deepspeed_config if plugin else {}


def _merged(model):
    record = engine_record(model, create=False)
    return record is not None and bool(record.proxies)


def merged_engine(accelerator):
    """The DeepSpeed engine of this accelerator that holds merged models, or None."""
    return next((m for m in accelerator._models if _merged(m)), None)


def merged_engines(accelerator):
    """Every DeepSpeed engine of this accelerator that holds merged models: one per optimizer of a GAN-style
    prepare() (merge/engine_per_optimizer.py), else at most one."""
    return [m for m in accelerator._models if _merged(m)]


def engines_read_in_parts(accelerator):
    """The ZeRO-3 engines whose models a script reads one by one: the merged ones, and a wrapper of models the
    script calls itself (kohya's --deepspeed, zero3/direct_calls.py)."""
    return [m for m in accelerator._models
            if _merged(m) or getattr(engine_record(m, create=False), "called_in_parts", False)]
