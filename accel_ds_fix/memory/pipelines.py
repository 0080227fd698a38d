"""What diffusers' and kohya's DreamBooth scripts do with each component of a diffusers pipeline folder, for
`plan --model`: which components go to prepare() (trained, or the frozen base a LoRA trains beside), which stay
frozen on the card next to them (T5 for the prompts of each step, the VAE), and how many parameters a LoRA of
rank r adds. Read from model_index.json and the safetensors headers; no weights are loaded."""

import dataclasses
import json
import os

from ..streaming import blocks
from . import model_files

# peft's LoRA on the text encoders, in every script below.
TEXT_ENCODER_LORA = ("q_proj", "k_proj", "v_proj", "out_proj")
_ATTENTION = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0")
_JOINT = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out")
_UNET = ("to_k", "to_q", "to_v", "to_out.0")  # train_dreambooth_lora_sdxl.py: every attention of the UNet


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    pipelines: tuple  # model_index.json's _class_name
    denoiser: str  # "transformer" or "unet"
    text_encoders: tuple  # what --train_text_encoder trains in the full fine-tune scripts
    lora_text_encoders: tuple  # ... in the LoRA scripts
    # frozen components the scripts keep on the card while training the text encoders, and the bytes an
    # element they keep them in there (the VAE in fp32 where the script says so; the rest in the training dtype)
    frozen_with_text_encoders: tuple
    vae_bytes: int
    lora_targets: tuple  # the denoiser's LoRA target modules (the LoRA script's default)
    resolution: int  # the scripts' usual training resolution
    activations: int  # bytes at that resolution, batch 1, gradient checkpointing (an estimate unless said)
    scripts: str
    # the denoiser's checkpointed buffers (not parameters: never trained, on the card whatever the tier)
    buffers: tuple = ()


GIB = 1024**3
FAMILIES = (
    Family("Flux.1", ("FluxPipeline",), "transformer", ("text_encoder",), ("text_encoder",),
           ("text_encoder_2",), 2,
           _ATTENTION + _JOINT + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
           512, int(0.5 * GIB),  # measured: 0.5 GiB at 512 px, 2.1 at 1024 (docs/gpu.md run 19)
           "diffusers train_dreambooth_flux.py, train_dreambooth_lora_flux.py (--train_text_encoder: CLIP-L)"),
    Family("SD3 / SD3.5", ("StableDiffusion3Pipeline",), "transformer",
           ("text_encoder", "text_encoder_2", "text_encoder_3"), ("text_encoder", "text_encoder_2"),
           ("text_encoder_3",), 4, _JOINT + _ATTENTION, 512, int(1.0 * GIB),  # 3.6 GiB measured at 1024 px (run 19)
           "diffusers train_dreambooth_sd3.py (--train_text_encoder: all three), train_dreambooth_lora_sd3.py "
           "(CLIP-L and CLIP-G)", buffers=("pos_embed.pos_embed",)),
    Family("SDXL", ("StableDiffusionXLPipeline",), "unet", ("text_encoder", "text_encoder_2"),
           ("text_encoder", "text_encoder_2"), (), 4, _UNET, 1024, int(3.1 * GIB),  # measured, docs/gpu.md run 19
           "diffusers train_dreambooth_lora_sdxl.py, kohya sdxl_train.py (--train_text_encoder: both CLIPs)"),
    Family("SD1.x / SD2.x", ("StableDiffusionPipeline",), "unet", ("text_encoder",), ("text_encoder",), (), 2,
           _UNET, 512, int(0.42 * GIB),
           "diffusers train_dreambooth.py, kohya train_db.py (--train_text_encoder: the CLIP text encoder)"),
)


@dataclasses.dataclass(frozen=True)
class Counted:
    """What `plan` needs of a pipeline for one way of training it."""

    family: Family
    components: dict  # component -> parameters
    prepared: tuple  # the components passed to prepare()
    params: int  # passed to prepare(), LoRA included
    trainable: int
    largest_trainable: int
    largest_weight: int  # elements of the largest weight prepared, frozen ones included
    weight_bytes: int  # bytes an element of the weights as handed to prepare()
    frozen_on_gpu: int  # bytes the script keeps on the card outside prepare()
    frozen_what: tuple  # (component, bytes)
    # bytes the script moves to the card itself before prepare(): the LoRA scripts' frozen base in the training
    # dtype (transformer.to(accelerator.device, dtype=weight_dtype)), whatever the tier does with it afterwards
    moved_before_prepare: int = 0
    # host bytes of every component once the script has loaded them, before its own casts and moves: diffusers
    # builds its models in fp32 (the scripts pass no torch_dtype), transformers >= 5 keeps the checkpoint's dtype
    loaded_bytes: int = 0
    # bytes of the largest layer of a ModuleList (a Flux double block, a T5 layer) among the frozen weights the
    # streaming tier may stream: what is on the card at once per block in flight
    largest_block: int = 0
    # bytes of the frozen weights of the prepared text encoders (a LoRA's base): kept on the card before the rest
    frozen_smaller_prepared: int = 0
    trained_tensors: int = 0  # the optimizer's tensors (a LoRA: two for each weight it wraps)

    def describe(self):
        parts = ", ".join(f"{c} {n / 1e6:.0f}M" + (" (prepared)" if c in self.prepared else "")
                          for c, n in self.components.items())
        return f"{self.family.name} pipeline: {parts}"


def family_of(folder):
    """The Family of a diffusers pipeline folder, or None where model_index.json names none of them."""
    with open(os.path.join(folder, "model_index.json"), encoding="utf-8") as f:
        name = json.load(f).get("_class_name", "")
    return next((fam for fam in FAMILIES if name in fam.pipelines), None)


def _lora_elements(shapes, targets, rank):
    """Elements of rank-r LoRA matrices (A: r x in, B: out x r) on each 2-D weight whose module name ends in a
    target, as peft matches them; the largest of those matrices; and how many weights it wraps (two tensors each)."""
    total = largest = wrapped = 0
    for key, shape in shapes.items():
        if not key.endswith(".weight") or len(shape) != 2:
            continue
        module = key[: -len(".weight")]
        if any(module == t or module.endswith("." + t) for t in targets):
            out_features, in_features = shape
            total += rank * (in_features + out_features)
            largest = max(largest, rank * in_features, rank * out_features)
            wrapped += 1
    return total, largest, wrapped


def count(folder, family, train_text_encoder=False, lora_rank=0, mixed_precision="bf16"):
    """Counted for training ``family``'s pipeline in ``folder`` as its scripts do: the full model, or (``lora_rank``)
    a LoRA of that rank; the text encoders with ``train_text_encoder``."""
    half = 4 if mixed_precision == "no" else 2
    present = [c for c in (family.denoiser, "text_encoder", "text_encoder_2", "text_encoder_3", "vae")
               if os.path.isdir(os.path.join(folder, c))]
    if family.denoiser not in present:
        raise ValueError(f"{folder} is a {family.name} pipeline without its {family.denoiser} folder")
    shapes = {c: model_files.folder_shapes(os.path.join(folder, c)) for c in present}
    buffers = sum(model_files.numel(shapes[family.denoiser].pop(b)) for b in family.buffers
                  if b in shapes[family.denoiser])
    components = {c: sum(model_files.numel(s) for s in shapes[c].values()) for c in present}
    trained_encoders = (family.lora_text_encoders if lora_rank else family.text_encoders) if train_text_encoder else ()
    prepared = (family.denoiser,) + tuple(c for c in trained_encoders if c in present)
    params = sum(components[c] for c in prepared)
    if lora_rank:
        trainable = largest = tensors = 0
        for c in prepared:
            targets = family.lora_targets if c == family.denoiser else TEXT_ENCODER_LORA
            n, big, wrapped = _lora_elements(shapes[c], targets, lora_rank)
            trainable, largest, tensors = trainable + n, max(largest, big), tensors + 2 * wrapped
        params += trainable
    else:
        trainable = params
        largest = max(model_files.numel(s) for c in prepared for s in shapes[c].values())
        tensors = sum(len(shapes[c]) for c in prepared)
    frozen = [(f"{family.denoiser} buffers", buffers * half)] if buffers else []
    if "vae" in present:
        frozen.append(("vae", components["vae"] * (family.vae_bytes if half == 2 else 4)))
    if train_text_encoder:  # the prompts are encoded each step, so the frozen encoders stay on the card
        kept = family.frozen_with_text_encoders + family.text_encoders
        frozen += [(c, components[c] * half) for c in dict.fromkeys(kept) if c in present and c not in prepared]
    largest_weight = max(model_files.numel(s) for c in prepared for s in shapes[c].values())
    moved = sum(components[c] for c in prepared) * half if lora_rank else 0
    loaded = sum(4 * components[c] if c in (family.denoiser, "vae")
                 else model_files.folder_bytes(os.path.join(folder, c)) or 4 * components[c] for c in present)
    streamable = [c for c in prepared if lora_rank] + [c for c, _ in frozen if c in shapes]
    return Counted(family, components, prepared, params, trainable, largest, largest_weight, half if lora_rank else 4,
                   sum(b for _, b in frozen), tuple(frozen), moved, loaded,
                   max((_largest_block(shapes[c]) * half for c in streamable), default=0),
                   sum(components[c] * half for c in prepared if c != family.denoiser) if lora_rank else 0, tensors)


def _largest_block(shapes):
    """Elements of the largest block, cut from the checkpoint's names as the streaming tier cuts the model
    (streaming/blocks.py: the children of the outermost lists, a large one cut at its inner lists)."""
    elements = {key: model_files.numel(shape) for key, shape in shapes.items()}
    return max((sum(elements[n] for n in names) for names in blocks.cut(elements).values()), default=0)
