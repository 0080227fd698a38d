"""A resumed engine's optimizer keeps the parameter-group dicts the learning-rate scheduler steps.

Under optimizer offload accelerate builds DeepSpeedCPUAdam from the script's optimizer's ``param_groups``; torch
keeps those very dicts, so the script's scheduler (built on its own optimizer) sets the learning rate the engine
steps with. DeepSpeed's load_checkpoint calls the optimizer's ``load_state_dict``, which replaces every group with a
new dict: from then on the scheduler decays a learning rate nobody reads, and the resumed run trains at the rate of
the save, drifting from the uninterrupted run from its second step (1e-3 relative by the third, with the scheduler
of examples/train_two_models.py). Here the dicts that were there before the load get the loaded values and go back
in place.
"""

import contextlib


def _base(engine):
    """The optimizer whose ``param_groups`` hold the learning rate of each step (inside DeepSpeed's ZeRO wrapper)."""
    optimizer = getattr(engine, "optimizer", None)
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "param_groups") else optimizer


@contextlib.contextmanager
def kept_across_load(engines):
    """Around accelerate's load_state: each engine's optimizer ends with its own group dicts, loaded."""
    before = []
    for engine in engines:
        base = _base(engine)
        if base is not None and hasattr(base, "param_groups"):
            before.append((base, list(base.param_groups)))
    yield
    for base, groups in before:
        if len(base.param_groups) != len(groups):
            continue  # another structure than the one saved: DeepSpeed has refused or said so already
        for index, (kept, loaded) in enumerate(zip(groups, base.param_groups)):
            if kept is not loaded:
                kept.update(loaded)  # the loaded values, and the loaded group's parameters
                base.param_groups[index] = kept
