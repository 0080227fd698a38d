"""Resuming ZeRO-3 with the optimizer offloaded to NVMe: what DeepSpeed 0.19.8's load_checkpoint leaves out.

With NVMe optimizer offload DeepSpeed copies the swap files saved in the checkpoint back and skips the rest of
its ZeRO checkpoint. Two things are then lost without a word, and training goes on from other states:

- A sub group kept in host memory (too small to swap, under aio's 1 MiB; or within the budget of
  nvme/sub_groups_in_ram.py) keeps its start-up master weights and Adam states, and the weights computed from them;
  the optimizer's learning rates stay as built until the next scheduler step.
- A swapped sub group gets its master weights back, but not Adam's states: its swapper swaps only the state
  tensors it has seen, and a new process's optimizer has none yet. The first step then starts Adam over as a
  fresh optimizer would (moments zero, step count 1) and writes those over the copied files. Seen on the CPU: the
  copied exp_avg files were right, the resumed step's were not, and the losses parted from the second step on.

This restores both from the checkpoint: kept sub groups from DeepSpeed's ZeRO file, swapped ones by swapping each
in, giving it the saved Adam states and step, and swapping it out (which registers the states with the swapper).
"""

import os

import torch

from .layout import universal_copy


def _checkpoint_file(engine, directory, tag):
    return engine._get_zero_ckpt_name(directory, tag)


def _swap_files(engine, directory, tag):
    """{sub group ds_id: {"fp32" | state name: path}} of this rank's swap files in the checkpoint (where DeepSpeed
    copied the swap folder from)."""
    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    return universal_copy.rank_swap_files(os.path.join(directory, tag), rank)


def _set_state(state, saved_state):
    for key, value in saved_state.items():
        if torch.is_tensor(value) and torch.is_tensor(state.get(key)):
            state[key].copy_(value)
        else:
            state[key] = value.clone() if torch.is_tensor(value) else value


def restore(engine, directory, tag):
    """After engine.load_checkpoint(directory, tag): put back what DeepSpeed skipped. No-op without NVMe."""
    optimizer = engine.optimizer
    if not getattr(optimizer, "swap_optimizer", False):
        return
    # memory-mapped: only what is copied out (the sub groups kept in RAM) is read into memory, not the whole file
    saved = torch.load(_checkpoint_file(engine, directory, tag), map_location="cpu", weights_only=False, mmap=True)
    saved = saved["optimizer_state_dict"]
    base = saved["optimizer_state_dict"]
    for group, saved_group in zip(optimizer.optimizer.param_groups, base["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    # The state dict numbers the flat fp32 sub groups parameter group by parameter group (stage3.py's
    # _set_fp32_optimizer_param_groups appends them in sub group order).
    groups = len(optimizer.optimizer.param_groups)
    order = [i for g in range(groups) for i in range(len(optimizer.fp16_groups)) if optimizer.sub_group_to_group_id[i] == g]
    files = _swap_files(engine, directory, tag)
    # the step count, as the swapped sub groups' entries may lack it (every sub group steps together)
    step = next((s["step"] for s in base["state"].values() if "step" in s), None)
    timers = set()
    for index, sub_group in enumerate(order):
        flat = optimizer.fp32_partitioned_groups_flat[sub_group]
        saved_state = base["state"].get(index, {})
        if optimizer._swappable_optimizer_subgroup(sub_group):
            states = files.get(flat.ds_id, {})
            if "exp_avg" not in states:  # saved before its first step: no Adam states yet, nothing was lost
                continue
            numel = int(optimizer.fp16_partitioned_groups_flat_numel[sub_group])
            optimizer._prepare_sub_group(sub_group, timers)  # master weights: the files DeepSpeed copied back
            state = optimizer.optimizer.state[flat]
            for key in ("exp_avg", "exp_avg_sq"):  # Adam's two states, from the checkpoint's files
                state[key] = universal_copy.read_swap_file(states[key], numel)
            counts = {"step": step} if step is not None else {}
            _set_state(state, {**counts, **{k: v for k, v in saved_state.items() if not torch.is_tensor(v)}})
            optimizer._release_sub_group(sub_group, timers)  # written out with its states, now the swapper's
            continue
        flat.data.copy_(saved["fp32_flat_groups"][sub_group])
        _set_state(optimizer.optimizer.state[flat], saved_state)
        optimizer.fp16_partitioned_groups_flat[sub_group].data.copy_(flat.data)
        optimizer._unflatten_partitioned_parameters(sub_group)
    optimizer.checkpoint_event_epilogue()  # gathers the persistent (small, never partitioned) parameters again
