"""The export of diffusers' train_dreambooth_lora_flux.py, checked without DeepSpeed: its LoRA file loads into
FluxPipeline (base: make_tiny_flux.py's folder) and generates; every lora_B (zero at the start) has changed; with
--same-as OTHER_RUN, whether both exports are bit-equal.

python check_flux_lora.py MODEL_FOLDER RUN_OUTPUT [--same-as OTHER_RUN_OUTPUT]
"""
import argparse
import json
import os

import torch
from safetensors.torch import load_file

p = argparse.ArgumentParser()
p.add_argument("model")
p.add_argument("run")
p.add_argument("--same-as")
a = p.parse_args()

from diffusers import FluxPipeline  # noqa: E402

lora = load_file(os.path.join(a.run, "pytorch_lora_weights.safetensors"))
by_model = {}
for key, tensor in lora.items():
    counts = by_model.setdefault(key.split(".")[0], {"tensors": 0, "lora_B": 0, "lora_B_nonzero": 0})
    counts["tensors"] += 1
    if "lora_B" in key:
        counts["lora_B"] += 1
        counts["lora_B_nonzero"] += int(bool(tensor.abs().sum() > 0))
result = {"lora": by_model}

pipe = FluxPipeline.from_pretrained(a.model)
pipe.load_lora_weights(a.run)
image = pipe("a photo of sks dog", height=32, width=32, num_inference_steps=2, max_sequence_length=16,
             guidance_scale=1.0, generator=torch.Generator().manual_seed(0)).images[0]
result["pipeline"] = {"image": list(image.size), "adapters": pipe.get_list_adapters()}
if a.same_as:
    other = load_file(os.path.join(a.same_as, "pytorch_lora_weights.safetensors"))
    result["bit_equal_to_other"] = other.keys() == lora.keys() and all(torch.equal(other[k], lora[k]) for k in lora)
print(json.dumps(result))
