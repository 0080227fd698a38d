"""Compare saved diffusers folders' unet/ and text_encoder/ weights.

python compare.py INITIAL TRAINED [OTHER_TRAINED]
With two folders: tensors and elements of TRAINED that differ from INITIAL, both rounded to the training precision
(CMP_DTYPE: fp16 or bf16; DeepSpeed's half-precision modes round the starting weights to it, and kohya may save
those in fp32).
With three: also how TRAINED and OTHER_TRAINED differ (max abs difference, tensors that differ).
Prints one JSON object.
"""
import glob
import json
import os
import sys

import torch
from safetensors.torch import load_file

TRAINING = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(os.environ.get("CMP_DTYPE"), torch.float32)


def load(folder, part):
    out = {}
    for f in sorted(glob.glob(os.path.join(folder, part, "*.safetensors"))):
        out.update(load_file(f))
    return out


result = {}
for part in ("unet", "text_encoder"):
    init, trained = load(sys.argv[1], part), load(sys.argv[2], part)
    common = [k for k in trained if k in init]
    changed = elements = changed_elements = 0
    for k in common:
        a, b = init[k].to(TRAINING), trained[k].to(TRAINING)
        diff = (a != b)
        changed += bool(diff.any())
        changed_elements += int(diff.sum())
        elements += b.numel()
    r = {"tensors": len(trained), "compared": len(common), "changed_tensors": changed,
         "changed_elements_pct": round(100 * changed_elements / max(elements, 1), 2),
         "saved_dtype": str(next(iter(trained.values())).dtype), "compared_in": str(TRAINING)}
    if len(sys.argv) > 3:
        other = load(sys.argv[3], part)
        d = [(trained[k].float() - other[k].float()).abs().max().item() for k in trained if k in other]
        r["vs_other_max_abs"] = max(d) if d else None
        r["vs_other_tensors_differ"] = sum(x > 0 for x in d)
    result[part] = r
print(json.dumps(result))
