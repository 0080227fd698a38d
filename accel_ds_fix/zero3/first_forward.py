"""Before a model's first forward: a callback from a pre-hook on every submodule (a script may call a part directly,
text_encoder.get_input_embeddings()(ids)), holding the model weakly. Used by zero3_unprepared (gather a frozen
model) and zero3_held_moves (carry out a held move); both also tell prepare()'s models from the others."""

import weakref


def watch(model, callback):
    """Call ``callback(model)`` before the forward of ``model`` or any of its submodules; returns the hook handles,
    for ``unwatch``."""
    reference = weakref.ref(model)

    def before_forward(*_):
        target = reference()
        if target is not None:
            callback(target)

    return [m.register_forward_pre_hook(before_forward) for m in model.modules()]


def unwatch(handles):
    for handle in handles:
        handle.remove()


def module_ids(models):
    """ids of ``models`` and of every module inside them: what prepare() hands to its engine."""
    return {id(m) for model in models for m in model.modules()}
