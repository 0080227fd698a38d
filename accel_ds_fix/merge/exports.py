"""unwrap_model / get_state_dict (and save_model, which calls it) for merged models: each model's own keys,
full tensors under ZeRO-3, never the merged engine's ``models.<name>.`` prefixes."""

from ..weights.full_weights import state_dict_for_saving
from .proxy import is_proxy


def _model_arg(args, kwargs):
    return args[0] if args else kwargs.get("model")


def unwrap_model(wrapped, instance, args, kwargs):
    """Accelerator.unwrap_model: a proxy unwraps to the user's own model."""
    model = _model_arg(args, kwargs)
    return model.__wrapped__ if is_proxy(model) else wrapped(*args, **kwargs)


def get_state_dict(wrapped, instance, args, kwargs):
    """Accelerator.get_state_dict: that model's own keys, full tensors."""
    model = _model_arg(args, kwargs)
    return state_dict_for_saving(model.__wrapped__) if is_proxy(model) else wrapped(*args, **kwargs)
