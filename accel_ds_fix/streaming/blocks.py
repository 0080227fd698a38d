"""Blocks: the unit that streams. A model's repeated layers sit in ModuleLists (Flux's transformer_blocks and
single_transformer_blocks, T5's encoder.block, a UNet's down_blocks); each child of the outermost such list is a
block, called as a whole, one after another. Frozen weights outside any list (embeddings, final norms) are few and
stay on the card."""

import dataclasses

import torch


@dataclasses.dataclass(eq=False)
class Block:
    module: torch.nn.Module
    name: str  # where it sits, for messages: "transformer.transformer_blocks.3"
    params: list  # its frozen parameters that stream (each only once, none shared with another block)
    nbytes: int  # their bytes in the training precision


def find(model, label, dtype_bytes):
    """The blocks of ``model`` with frozen weights, in the order the model holds them; ``dtype_bytes(p)``: a
    parameter's size on the card."""
    found = []

    def walk(module, prefix):
        for name, child in module.named_children():
            path = f"{prefix}.{name}"
            if isinstance(child, torch.nn.ModuleList):
                found.extend((f"{path}.{i}", block) for i, block in enumerate(child))
            else:
                walk(child, path)

    walk(model, label)
    owners = {}
    for _, block in found:
        for p in block.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    blocks = []
    for name, module in found:
        # a weight tied to another block's stays on the card: one copy serves both
        params = [p for p in module.parameters() if not p.requires_grad and owners[id(p)] == 1]
        if params:
            blocks.append(Block(module, name, params, sum(dtype_bytes(p) for p in params)))
    return blocks


def split(blocks, on_card):
    """(resident, streamed): blocks in order stay on the card while their bytes fit ``on_card``; the rest stream."""
    resident, streamed, used = [], [], 0
    for block in blocks:
        if not streamed and used + block.nbytes <= on_card:
            resident.append(block)
            used += block.nbytes
        else:
            streamed.append(block)
    return resident, streamed
