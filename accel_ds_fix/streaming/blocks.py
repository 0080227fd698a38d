"""Blocks: the unit that streams. A model's repeated layers sit in lists (Flux's transformer_blocks and
single_transformer_blocks, T5's encoder.block, a UNet's down_blocks): their weights' names hold the list index
("transformer_blocks.3.attn.to_q.weight"), and each child of the outermost list is a block, called as a whole, one
after another. Frozen weights outside any list (embeddings, final norms) are few and stay on the card.

A block too large to stream well is cut at its own inner lists: SDXL's up_blocks.0 holds 47 % of the UNet (2.4 GB
in bf16), and two such blocks on the card at once (the one computing, the next one copied) would fill an 8 GB card;
its inner lists (resnets, attentions, each attention's transformer_blocks) are the units the UNet calls and
gradient checkpointing recomputes. The cut works on names alone, so that `plan` cuts a checkpoint's header
(memory/pipelines.py) as the run cuts the model."""

import dataclasses

# a block above this share of its model's frozen elements is cut at its inner lists...
LARGEST_SHARE = 1 / 16
# ...where those lists hold at least this share of the block (Flux's blocks hold small lists, attn.to_out and
# ff.net: cutting there would leave most of the block outside any block)
INNER_LISTS_SHARE = 0.9


@dataclasses.dataclass(eq=False)
class Block:
    module: object  # torch.nn.Module
    name: str  # where it sits, for messages: "transformer.transformer_blocks.3"
    params: list  # its frozen parameters that stream (each only once, none shared with another block)
    nbytes: int  # their bytes in the training precision


def _list_prefix(parts, start):
    """The name up to the first list index at or after ``start`` ("down_blocks.1"), or None."""
    for i in range(start, len(parts) - 1):
        if parts[i].isdigit():
            return parts[:i + 1]
    return None


def _groups(names, depth):
    """{prefix up to the first list index at or after component ``depth``: [names under it]}."""
    groups = {}
    for name in names:
        prefix = _list_prefix(name.split("."), depth)
        if prefix:
            groups.setdefault(".".join(prefix), []).append(name)
    return groups


def cut(elements):
    """The blocks of a model from its weights' names: ``elements`` maps each name to its element count (in the
    model's order); returns {block name: [weight names]} in that order. Names in no block stay on the card."""
    total = sum(elements.values()) or 1

    def refine(block, names):
        depth = block.count(".") + 1
        inner = _groups(names, depth)
        size = sum(elements[n] for n in names)
        in_lists = sum(elements[n] for group in inner.values() for n in group)
        # a list of lists (kohya's SDXL UNet: input_blocks.4.1) has no forward of its own: always cut; a large
        # block where its inner lists hold nearly all of it
        nested = all(name.split(".")[depth].isdigit() for name in names)
        if not inner or not (nested or size > LARGEST_SHARE * total and in_lists >= INNER_LISTS_SHARE * size):
            return {block: names}
        found = {}
        for child, child_names in inner.items():
            found.update(refine(child, child_names))
        return found

    blocks = {}
    for block, names in _groups(elements, 0).items():
        blocks.update(refine(block, names))
    return blocks


def find(model, label, dtype_bytes):
    """The blocks of ``model`` with frozen weights, in the order the model holds them; ``dtype_bytes(p)``: a
    parameter's size on the card."""
    every = list(model.named_parameters(remove_duplicate=False))
    owners = {}
    for _, p in every:
        owners[id(p)] = owners.get(id(p), 0) + 1
    frozen = {}
    for name, p in every:
        if not p.requires_grad and name not in frozen and owners[id(p)] == 1:
            frozen[name] = p
    params = dict(every)
    blocks = []
    for block, names in cut({name: p.numel() for name, p in frozen.items()}).items():
        module = model.get_submodule(block)
        # a weight tied to another's (owned twice) stays on the card: one copy serves both
        streamed = [params[name] for name in names]
        blocks.append(Block(module, f"{label}.{block}", streamed, sum(dtype_bytes(p) for p in streamed)))
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
