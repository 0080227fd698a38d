"""accelerator.clip_grad_norm_(parameters, max_norm) under one merged engine, applied as plain accelerate applies it.

Without DeepSpeed a script's backward computes the gradients, clip_grad_norm_ scales them to max_norm over the
parameters it names, and optimizer.step() steps. Under DeepSpeed accelerate's backward steps the engine at once,
clipped at the config's gradient_clipping over the engine's own parameters, and clip_grad_norm_ only reports the
norm. A parameter that the script makes trainable after prepare() and that no optimizer holds (diffusers' LoRA
scripts turn the text encoder's embeddings on for gradient checkpointing) has a gradient that plain accelerate's
norm counts and DeepSpeed's does not: the Flux LoRA script's adapters ended 4 steps 8.3e-4 away from plain
accelerate's.

Here the merged engine's step waits, from accelerator.backward, for the script's clip_grad_norm_, its
optimizer.step() or its next backward or save_state, whichever comes first. At clip_grad_norm_ the step runs with
the script's max_norm and a norm that also counts the gradients of the parameters it names outside DeepSpeed's
optimizer (those stay each process's own, as DDP leaves a parameter made trainable after its wrapping); the norm
returned is that one, as plain accelerate returns. Under ZeRO 1 - 3, offload included; one engine per optimizer
and ZeRO stage 0 keep DeepSpeed's own clipping (docs/your-script.md).
"""

import contextlib

import torch

from ..lookup import engine_record, merged_engines


def arm(engine, optimizer):
    """In prepare(), for the one merged engine of the call: accelerate's backward holds its step from now on, and
    the script's ``optimizer.step()`` (accelerate's wrapper, a no-op under DeepSpeed) runs a held step."""
    base = engine.optimizer
    if not (hasattr(base, "scaled_global_norm") or hasattr(base, "_get_norm_groups")):
        return  # no ZeRO optimizer whose norm this knows: DeepSpeed clips as it does
    record = engine_record(engine)
    record.real_step = engine.step

    def step(*args, **kwargs):
        if record.holding_step:
            record.step_pending = (args, kwargs)
            return None
        return record.real_step(*args, **kwargs)

    engine.step = step
    if optimizer is not None:
        script_step = optimizer.step

        def optimizer_step(*args, **kwargs):
            run_held_step(engine)
            return script_step(*args, **kwargs)

        optimizer.step = optimizer_step


def hold_step(wrapped, instance, args, kwargs):
    """Accelerator.backward: the merged engine's step is held (a step still held from the last backward runs
    first)."""
    engines = [e for e in merged_engines(instance) if holds_steps(e)]
    if len(engines) != 1:
        return wrapped(*args, **kwargs)
    record = engine_record(engines[0])
    run_held_step(engines[0])
    record.holding_step = True
    try:
        return wrapped(*args, **kwargs)
    finally:
        record.holding_step = False


def step_first(wrapped, instance, args, kwargs):
    """Accelerator.save_state: a held step runs before the state is saved."""
    for engine in merged_engines(instance):
        run_held_step(engine)
    return wrapped(*args, **kwargs)


def run_held_step(engine, parameters=None, max_norm=None):
    """Run the step accelerate's backward asked for, if one is held; with ``max_norm``, clipped to it over the
    engine's gradients and those of ``parameters`` outside its optimizer. Returns whether a step ran."""
    record = engine_record(engine, create=False)
    if record is None or record.step_pending is None:
        return False
    args, kwargs = record.step_pending
    record.step_pending = None
    with _clipped(engine, record, parameters, max_norm):
        record.real_step(*args, **kwargs)
    return True


def clips_part_of_the_engine(engine, parameters):
    """How many of the parameters DeepSpeed trains in ``engine`` the script's clip leaves out (DeepSpeed clips all
    of them together: the script's set should name them all)."""
    record = engine_record(engine, create=False)
    named = {id(p) for p in parameters}
    return len((record.trained or set()) - named) if record is not None else 0


def holds_steps(engine):
    record = engine_record(engine, create=False)
    return record is not None and record.real_step is not None


def _outside(record, parameters):
    """The gradients of ``parameters`` that DeepSpeed's optimizer does not hold (a parameter DeepSpeed trains
    keeps its gradient in DeepSpeed's buffers), and their norm (None where there are none)."""
    trained = record.trained or set()
    grads = [p.grad for p in parameters if id(p) not in trained and getattr(p, "grad", None) is not None]
    grads = [g for g in grads if g.numel()]
    if not grads:
        return [], None
    return grads, torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))


@contextlib.contextmanager
def _clipped(engine, record, parameters, max_norm):
    base = engine.optimizer
    grads, outside = _outside(record, parameters) if max_norm is not None and parameters else ([], None)
    clip, loss_scale = base.clip_grad, float(getattr(base, "loss_scale", 1.0) or 1.0)
    if max_norm is not None:
        base.clip_grad = float(max_norm)
    if outside is not None:
        if hasattr(base, "scaled_global_norm"):  # ZeRO-1/2 (the gradients already carry the loss scale)
            own = base.scaled_global_norm
            base.scaled_global_norm = lambda *a, **k: _combined(own(*a, **k), outside)
        else:  # ZeRO-3: one more group in its norm
            own = base._get_norm_groups
            base._get_norm_groups = lambda: _with_outside(own(), outside)
    try:
        yield
    finally:
        base.clip_grad = clip
        for name in ("scaled_global_norm", "_get_norm_groups"):
            base.__dict__.pop(name, None)
    if grads:  # clipped (and unscaled) in place, as torch's clip_grad_norm_ leaves them: they accumulate on
        norm = float(engine.get_global_grad_norm() or 0.0)
        coefficient = min(1.0, float(max_norm) / (norm + 1e-6)) / loss_scale
        if coefficient != 1.0 and norm == norm:  # a skipped (overflow) step leaves them as they are
            for g in grads:
                g.mul_(coefficient)


def _combined(norm, outside):
    if not torch.is_tensor(norm):
        norm = torch.tensor(float(norm))
    outside = outside.to(norm.device)
    invalid = ~torch.isfinite(norm) | (norm < 0)  # DeepSpeed's overflow sentinels stay what they are
    return torch.where(invalid, norm, torch.sqrt(norm.float() ** 2 + outside ** 2).to(norm.dtype))


def _with_outside(norms, outside):
    device = next((n.device for n in norms if torch.is_tensor(n)), outside.device)
    return [*norms, outside.to(device)]
