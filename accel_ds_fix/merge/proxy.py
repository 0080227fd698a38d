"""The object handed back in each model's place: the user's model, run through the shared DeepSpeed engine."""

import copy

import wrapt

from ..processes import deferred_save
from ..weights.full_weights import load_full_weights
from ..zero3 import forward_alone
from .merged_module import TARGET_KEYWORD


class ModelProxy(wrapt.BaseObjectProxy):
    """Behaves like the wrapped model (``isinstance``, attributes, ``parameters()``, ``train()``/``eval()``).

    Calling it calls the DeepSpeed engine, so DeepSpeed's forward work (ZeRO-3 parameter gathering, fp16
    input casting, gradient hooks) applies exactly as for a single prepared model.
    """

    def __init__(self, model, engine, name):
        super().__init__(model)
        self._self_engine = engine
        self._self_name = name

    def __call__(self, *args, **kwargs):
        # several processes: a save_state the main process alone asked for; a ZeRO-3 forward on it alone
        deferred_save.at_training_forward()
        forward_alone.check(self.__wrapped__)
        kwargs[TARGET_KEYWORD] = self._self_name
        return self._self_engine(*args, **kwargs)

    # nn.Module.train() returns the module itself; return the proxy so `model = model.train()` keeps routing.
    def train(self, mode=True):
        self.__wrapped__.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # Load hooks of training scripts (diffusers' `model.load_state_dict(...)`, peft's set_peft_model_state_dict)
    # write into the model they are given; under ZeRO-3 its parameters are shape-[0] shards outside forward.
    def load_state_dict(self, state_dict, *args, **kwargs):
        return load_full_weights(self.__wrapped__, state_dict, *args, **kwargs)

    def __copy__(self):
        return copy.copy(self.__wrapped__)

    def __deepcopy__(self, memo):
        # A copy (an EMA model, say) is a plain module of its own, not a second view of the engine.
        return copy.deepcopy(self.__wrapped__, memo)

    def __reduce_ex__(self, protocol):
        return self.__wrapped__.__reduce_ex__(protocol)

    def __repr__(self):
        return f"<accel_ds_fix proxy of {type(self.__wrapped__).__name__} as models.{self._self_name}>"


def name_the_models(error, models):
    """Where a script's exception names the proxy's type (its own ``type(model)`` check in a save or load hook),
    add a note naming the models the proxies stand for: without the fix the error would name their classes."""
    proxies = [m for m in models if is_proxy(m)]
    if not proxies or "ModelProxy" not in str(error) or not hasattr(error, "add_note"):
        return
    stood = ", ".join(f"{type(p.__wrapped__).__name__} (models.{p._self_name})" for p in proxies)
    error.add_note(
        f"accel_ds_fix: ModelProxy in this error is the fix's stand-in for a merged model; the hook was given "
        f"{stood}. Without DeepSpeed the error would name the model's own class: the script checks type(model), "
        "which is the stand-in's, where isinstance(model, TheClass) holds for it, or "
        "accelerator.unwrap_model(model) gives the model itself."
    )


def is_proxy(obj):
    # type(), not isinstance(): a proxy reports the wrapped model's class to isinstance().
    return issubclass(type(obj), ModelProxy)


def unwrap(obj):
    """The user's own model behind a proxy; anything else unchanged."""
    return obj.__wrapped__ if is_proxy(obj) else obj
