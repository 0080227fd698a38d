"""Resuming ZeRO-3 with the optimizer offloaded to NVMe: what DeepSpeed 0.19.8's load_checkpoint leaves out.

With NVMe optimizer offload DeepSpeed copies the swap files saved in the checkpoint back and skips the rest
of its ZeRO checkpoint. A sub group too small to be swapped (under aio's 1 MiB: a small model, or the last
sub group of a parameter group) lives in host memory instead, so its master weights and Adam states keep
their start-up values, and so do the weights computed from them; the optimizer's learning rates stay as built
until the next scheduler step. Training then silently continues from other weights (seen on the CPU: the
same with a hand-written merged module). This restores both from the checkpoint file DeepSpeed wrote.
"""

import torch


def _checkpoint_file(engine, directory, tag):
    return engine._get_zero_ckpt_name(directory, tag)


def restore_unswapped(engine, directory, tag):
    """After engine.load_checkpoint(directory, tag): put back what DeepSpeed skipped. No-op without NVMe."""
    optimizer = engine.optimizer
    if not getattr(optimizer, "swap_optimizer", False):
        return
    saved = torch.load(_checkpoint_file(engine, directory, tag), map_location="cpu", weights_only=False)
    saved = saved["optimizer_state_dict"]
    base = saved["optimizer_state_dict"]
    for group, saved_group in zip(optimizer.optimizer.param_groups, base["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    # The state dict numbers the flat fp32 sub groups parameter group by parameter group (stage3.py's
    # _set_fp32_optimizer_param_groups appends them in sub group order).
    groups = len(optimizer.optimizer.param_groups)
    order = [i for g in range(groups) for i in range(len(optimizer.fp16_groups)) if optimizer.sub_group_to_group_id[i] == g]
    restored = False
    for index, sub_group in enumerate(order):
        if optimizer._swappable_optimizer_subgroup(sub_group):
            continue  # restored by DeepSpeed from the swap files
        flat = optimizer.fp32_partitioned_groups_flat[sub_group]
        flat.data.copy_(saved["fp32_flat_groups"][sub_group])
        state = optimizer.optimizer.state[flat]
        for key, value in base["state"].get(index, {}).items():
            if torch.is_tensor(value) and torch.is_tensor(state.get(key)):
                state[key].copy_(value)
            else:
                state[key] = value.clone() if torch.is_tensor(value) else value
        optimizer.fp16_partitioned_groups_flat[sub_group].data.copy_(flat.data)
        optimizer._unflatten_partitioned_parameters(sub_group)
        restored = True
    if restored:
        optimizer.checkpoint_event_epilogue()  # gathers the persistent (small, never partitioned) parameters again
