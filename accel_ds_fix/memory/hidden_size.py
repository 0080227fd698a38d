"""A model's hidden size: what DeepSpeed's "auto" bucket sizes and the memory model's buffers are computed from."""

import torch


def _config_hidden_size(config):
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    if get("hidden_size"):
        return int(get("hidden_size"))
    for key in ("hidden_sizes", "block_out_channels"):  # transformers vision models, diffusers UNets
        sizes = get(key)
        if sizes:
            return int(max(sizes))
    return None


def hidden_size_of(model):
    """The model's own hidden size if its config says so, else the widest Linear layer, else 1."""
    config = getattr(model, "config", None)
    if config is not None:
        size = _config_hidden_size(config)
        if size:
            return size
    widths = [max(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return max(widths, default=1)
