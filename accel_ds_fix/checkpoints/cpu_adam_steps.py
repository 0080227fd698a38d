"""DeepSpeed's CPU Adam (ZeRO's optimizer offload, the NVMe tier) resumed with the bias corrections of the run
that saved.

Its C++ optimizer keeps beta1**step and beta2**step in float32 and multiplies each by its beta once a step. A new
process starts from step 0, so the first step after load_state takes std::pow(beta, step) instead, which differs
from the product in the last bit at some steps: a resume of a save after step 2 ended step 4 with losses 6e-7 from
the run that went on (saves after steps 1, 3, 4, 6: bit-equal). Replaying the step counter from 1, with empty
tensors (no weight moves), builds the product exactly as the saving run had it.
"""


def replay_steps(engine):
    """After a load into ``engine``: bring its CPU Adam's step counter to the loaded step, one step at a time, with
    one call for each state the optimizer holds in the order step() calls them (ZeRO-3 steps its sub groups one by
    one, with their groups' parameter lists emptied in between)."""
    base = getattr(engine.optimizer, "optimizer", None)
    if getattr(base, "ds_opt_adam", None) is None:  # not DeepSpeed's CPU Adam: bias corrections in Python
        return
    import torch

    group_of = {id(p): group for group in base.param_groups for p in group["params"]}
    calls = [(int(state["step"]), group_of.get(id(p), base.param_groups[0]))
             for p, state in base.state.items() if "step" in state]
    empty = torch.empty(0)
    for step in range(1, max((last for last, _ in calls), default=0) + 1):
        for last, group in calls:
            if step <= last:
                beta1, beta2 = group["betas"]
                base.ds_opt_adam.adam_update(base.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                             group["weight_decay"], group["bias_correction"], empty, empty, empty,
                                             empty)
