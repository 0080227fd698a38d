"""What plain accelerate's save_state writes and load_state reads (accelerate's checkpointing.py), and the one
optimizer whose states both sides keep alike: Adam (torch's Adam / AdamW, DeepSpeed's CPU Adam under offload) with
exp_avg, exp_avg_sq and a step count per parameter."""

import os

import torch

OPTIMIZER_FILE = "optimizer.bin"
ADAM_STATES = ("exp_avg", "exp_avg_sq")


def model_file(directory, index):
    """The weights file plain accelerate wrote for its ``index``-th model (safetensors or torch.save), or None."""
    ending = f"_{index}" if index else ""
    for name in (f"model{ending}.safetensors", f"pytorch_model{ending}.bin"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def written_by_plain_accelerate(directory):
    """Whether ``directory`` holds a checkpoint of plain accelerate: its optimizer file or a model's weights file,
    and no DeepSpeed checkpoint (the ``latest`` file DeepSpeed writes beside its tag folders)."""
    if not os.path.isdir(directory) or os.path.isfile(os.path.join(directory, "latest")):
        return False
    return os.path.isfile(os.path.join(directory, OPTIMIZER_FILE)) or model_file(directory, 0) is not None


def read_weights(path):
    """A model's state dict from plain accelerate's file, on the CPU."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    return torch.load(path, map_location="cpu", weights_only=False)


def adam_refusal(optimizer):
    """Why ``optimizer`` (the script's, unwrapped) keeps other states than Adam's, in words; None where it is Adam."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and name != "DeepSpeedCPUAdam":
        return f"its optimizer is {type(optimizer).__module__}.{name}, whose states are not Adam's"
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        return "its Adam has amsgrad=True (max_exp_avg_sq, which DeepSpeed's checkpoint does not hold)"
    return None


def step_value(step):
    """A step count as a number, whichever form it was kept in (torch's Adam: a tensor; DeepSpeed's CPU Adam: an
    int)."""
    return float(step.item() if torch.is_tensor(step) else step)
