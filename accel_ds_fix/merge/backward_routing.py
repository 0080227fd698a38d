"""accelerator.backward(loss) with one DeepSpeed engine per optimizer: the loss goes to the engine it trains.

accelerate ties ``accelerator.backward`` to the first engine it built. Here the engine is found from the loss
itself (whose trainable parameters its graph reaches) and, where the loss reaches two engines' parameters (a
generator loss through a discriminator that still requires grad), from ``accelerator.accumulate(model)``.

What the other engines get from that backward: nothing. Their parameters are left out of the backward
(``inputs=``), so neither ``.grad`` nor DeepSpeed's gradient hooks of those engines see the loss, and the
output hooks each engine puts on its forward outputs (DeepSpeed >= 0.18.3: a backward prologue, and a 1/GA scaling
of the gradient where the graph is not an engine.backward's) run only for the engine being trained. That is
what the same script gets without DeepSpeed as long as the other optimizer's ``zero_grad()`` clears those
gradients before its own backward (diffusers' train_vqgan.py does); where it does not, the other engine's next
backward is refused (without DeepSpeed the stale gradients would add to its update).
"""

import contextlib

import torch

from ..errors import MergeError
from ..lookup import accelerator_record, engine_record

# The engine whose backward runs now (its output hooks act, the others' do not). A module global, not a
# thread-local: on a GPU, autograd runs tensor hooks on its own device threads, not the thread that called backward.
_routed = None


def _routed_engine():
    return _routed


def gate_output_hooks(engine):
    """DeepSpeed's hooks on this engine's forward outputs act only in this engine's own routed backward.

    Both are looked up when a forward runs (the prologue by name, the per-tensor scaling as a bound method), so
    instance attributes set before the first forward replace them. Outside any routed backward (the script's own
    torch.autograd.grad: vqgan's adaptive weight and gradient penalty) they do nothing, as without DeepSpeed."""
    prologue, per_tensor = engine._backward_prologue, engine._backward_prologue_per_tensor

    def _backward_prologue():
        if _routed_engine() is engine:
            prologue()

    def _backward_prologue_per_tensor(grad):
        return per_tensor(grad) if _routed_engine() is engine else grad

    engine._backward_prologue = _backward_prologue
    engine._backward_prologue_per_tensor = _backward_prologue_per_tensor


def manage(accelerator, engine, optimizer, label):
    """Called once per engine built from a several-optimizer prepare()."""
    accelerator_record(accelerator).engines.append(engine)
    record = engine_record(engine)
    record.label = label
    record.owned = {id(p) for p in engine.module.parameters()}
    record.dropped = None
    gate_output_hooks(engine)
    if optimizer is not None:
        _clear_dropped_on_zero_grad(engine, optimizer)


def _clear_dropped_on_zero_grad(engine, optimizer):
    # accelerate's DeepSpeed optimizer wrapper makes zero_grad() a no-op; without DeepSpeed it clears the
    # gradients whenever accelerate syncs (AcceleratedOptimizer.zero_grad): what another engine's loss left
    # in this engine's parameters is gone then, here as there.
    original = optimizer.zero_grad

    def zero_grad(*args, **kwargs):
        if optimizer.gradient_state.sync_gradients:
            engine_record(engine).dropped = None
        return original(*args, **kwargs)

    optimizer.zero_grad = zero_grad


def engines(accelerator):
    """The engines of a several-optimizer prepare() that the accelerator still holds (free_memory() drops them)."""
    record = accelerator_record(accelerator, create=False)
    held = record.engines if record is not None else []
    return [engine for engine in held if any(engine is model for model in accelerator._models)]


@contextlib.contextmanager
def recording_accumulate(accelerator, models, inner):
    """accelerator.accumulate(*models): remember the models, which name the engine a shared loss trains."""
    flat = []
    for model in models:
        flat.extend(model if isinstance(model, (list, tuple)) else [model])
    stack = accelerator_record(accelerator).accumulating
    stack.append(flat)
    try:
        with inner:
            yield
    finally:
        stack.pop()


def accumulate(wrapped, instance, args, kwargs):
    inner = wrapped(*args, **kwargs)
    if not engines(instance):
        return inner
    return recording_accumulate(instance, args, inner)


def _reached_leaves(loss):
    """The leaf tensors that a backward of ``loss`` would accumulate gradients into, in graph order."""
    seen, stack, leaves = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if variable is not None:
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _engine_of(model, managed):
    engine = getattr(model, "_self_engine", None)  # a proxy
    if engine is None and model in managed:
        engine = model
    return engine


def _names(engine):
    return engine_record(engine).label


def _target(accelerator, reached):
    managed = engines(accelerator)
    if not reached:
        raise MergeError(
            "accel_ds_fix: accelerator.backward(loss) got a loss that reaches no trainable parameter of the models "
            f"prepared with several optimizers ({'; '.join(_names(e) for e in managed)}): nothing to train. Compute "
            "the loss from the models prepare() returned, with requires_grad on the parameters to train."
        )
    if len(reached) == 1:
        return reached[0]
    record = accelerator_record(accelerator, create=False)
    stack = (record.accumulating if record is not None else None) or [[]]
    named = [e for e in (_engine_of(m, managed) for m in stack[-1]) if e is not None]
    chosen = [e for e in reached if e in named]
    if len(chosen) == 1:
        return chosen[0]
    raise MergeError(
        "accel_ds_fix: this loss reaches the trainable parameters of "
        + " and of ".join(_names(e) for e in reached)
        + ", each an engine of its own optimizer, and nothing says which one it trains. Run the backward inside "
        "`with accelerator.accumulate(model):` naming the model it trains (diffusers' train_vqgan.py does: the "
        "other engine then gets no gradient from it, as its own zero_grad() would clear it without DeepSpeed), "
        "or keep the loss off the other model's parameters (detach its input, or requires_grad_(False) on them "
        "for this phase). Training both from one loss needs one optimizer holding both models."
    )


@contextlib.contextmanager
def _backward_into(inputs):
    """DeepSpeed's engine.backward calls loss.backward(retain_graph=...): give it ``inputs``, so gradients reach
    only these leaves (another engine's parameters: no .grad, no DeepSpeed gradient hook)."""
    original = torch.Tensor.backward

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        return original(self, gradient, retain_graph, create_graph, inputs=inputs if inputs is not None else chosen)

    chosen = inputs
    torch.Tensor.backward = backward
    try:
        yield
    finally:
        torch.Tensor.backward = original


@contextlib.contextmanager
def _routed_to(engine):
    global _routed
    previous, _routed = _routed, engine
    try:
        yield
    finally:
        _routed = previous


def backward(accelerator, loss, **kwargs):
    """Run ``loss``'s backward, and at a sync step the optimizer step, of the engine the loss trains; return it."""
    managed = engines(accelerator)
    leaves = _reached_leaves(loss) if getattr(loss, "grad_fn", None) is not None else []
    owner_of = {}
    for engine in managed:
        for leaf in leaves:
            if id(leaf) in engine_record(engine).owned:
                owner_of[id(leaf)] = engine
    reached = [e for e in managed if any(owner_of.get(id(leaf)) is e for leaf in leaves)]
    target = _target(accelerator, reached)
    if engine_record(target).dropped:
        raise MergeError(
            f"accel_ds_fix: this loss trains {_names(target)}, but {engine_record(target).dropped} Without DeepSpeed "
            "those gradients would stay in the parameters' .grad and add to this update; under DeepSpeed each "
            "engine gets only the gradients of its own backward. Call this engine's optimizer.zero_grad() before "
            "its phase (diffusers' train_vqgan.py does), or keep the other loss off these parameters (detach its "
            "input, or requires_grad_(False) on them during the other phase, as TiTok's trainers do)."
        )
    for other in reached:
        if other is not target:
            engine_record(other).dropped = (
                f"an earlier loss that trained {_names(target)} also reached its trainable parameters, and its "
                "optimizer's zero_grad() has not run since (at a step where accelerate syncs gradients)."
            )
    inputs = [leaf for leaf in leaves if owner_of.get(id(leaf), target) is target]
    with _backward_into(inputs), _routed_to(target):
        engine_record(target).wrapper.backward(loss, sync_gradients=accelerator.sync_gradients, **kwargs)
    return target
