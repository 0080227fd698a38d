"""kohya's LoRA network of January 2023 (sd-scripts networks/lora.py, trained by train_network.py), in our own
words: a module of its own whose LoRA layers are patched into the forwards of the UNet's and the text encoder's
layers, so the network's own forward is never called. Used by tests/scenarios.py and bench/sd15_6gb.py."""

import math

import torch

# The module classes whose Linear (and 1x1 Conv2d) layers kohya's LoRA targets, in SD1.5's diffusers/transformers.
UNET_TARGETS = ("Transformer2DModel", "Attention", "CrossAttention")
TEXT_ENCODER_TARGETS = ("CLIPAttention", "CLIPMLP")


def _adaptable(module):
    return isinstance(module, torch.nn.Linear) or (isinstance(module, torch.nn.Conv2d) and module.kernel_size == (1, 1))


def kohya_targets(model, prefix, classes):
    """(LoRA name, layer) for each layer kohya's create_modules() picks in ``model``, each layer once."""
    found = {}
    for name, module in model.named_modules():
        if type(module).__name__ not in classes:
            continue
        for child_name, child in module.named_modules():
            if _adaptable(child) and id(child) not in found:
                found[id(child)] = (f"{prefix}.{name}.{child_name}".replace(".", "_"), child)
    return list(found.values())


class LoRAModule(torch.nn.Module):
    """x -> layer(x) + up(down(x)) * alpha / rank, with ``up`` starting at zero (kohya's initialisation)."""

    def __init__(self, lora_name, layer, rank=4, alpha=1.0):
        super().__init__()
        self.lora_name = lora_name
        if isinstance(layer, torch.nn.Conv2d):
            self.lora_down = torch.nn.Conv2d(layer.in_channels, rank, 1, bias=False)
            self.lora_up = torch.nn.Conv2d(rank, layer.out_channels, 1, bias=False)
        else:
            self.lora_down = torch.nn.Linear(layer.in_features, rank, bias=False)
            self.lora_up = torch.nn.Linear(rank, layer.out_features, bias=False)
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.scale = alpha / rank
        torch.nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        torch.nn.init.zeros_(self.lora_up.weight)
        self._layer = [layer]  # in a list: the patched layer belongs to its own model, not to the network

    def apply_to(self):
        layer = self._layer.pop()
        self.original_forward = layer.forward
        layer.forward = self.forward

    def forward(self, x):
        return self.original_forward(x) + self.lora_up(self.lora_down(x)) * self.scale


class LoRANetwork(torch.nn.Module):
    """kohya's LoRANetwork: one LoRAModule per target layer, registered under its LoRA name."""

    def __init__(self, text_encoder_targets, unet_targets, rank=4, alpha=1.0):
        super().__init__()
        self.text_encoder_loras = [LoRAModule(name, layer, rank, alpha) for name, layer in text_encoder_targets]
        self.unet_loras = [LoRAModule(name, layer, rank, alpha) for name, layer in unet_targets]
        for lora in self.text_encoder_loras + self.unet_loras:
            self.add_module(lora.lora_name, lora)

    @classmethod
    def for_stable_diffusion(cls, text_encoder, unet, rank=4, alpha=1.0):
        return cls(kohya_targets(text_encoder, "lora_te", TEXT_ENCODER_TARGETS),
                   kohya_targets(unet, "lora_unet", UNET_TARGETS), rank, alpha)

    def apply_to(self):
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.apply_to()

    def prepare_optimizer_params(self, text_encoder_lr, unet_lr):
        """One parameter group per model, with its own learning rate, as train_network.py builds its optimizer."""
        def params(loras):
            return [p for lora in loras for p in lora.parameters()]

        return [{"params": params(self.text_encoder_loras), "lr": text_encoder_lr},
                {"params": params(self.unet_loras), "lr": unet_lr}]

    def save_weights(self, file, save_file, dtype=None):
        """kohya's save: state_dict() as it is unless a save precision is given, then ``save_file`` (safetensors)."""
        state = self.state_dict()
        if dtype is not None:
            state = {k: v.detach().clone().to("cpu").to(dtype) for k, v in state.items()}
        save_file(state, file)
