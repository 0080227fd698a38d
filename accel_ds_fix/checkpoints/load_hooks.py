"""The script's load_state pre-hooks under merged models: run, explained where they fail, or skipped on request.

With merged models the hooks get the models themselves, as without DeepSpeed, and DeepSpeed's checkpoint then
restores every weight of those models (save_load.load_state), over whatever the hooks loaded. Scripts written for
plain DeepSpeed, where accelerate hands the hooks the engine, may branch on `accelerator.distributed_type ==
DistributedType.DEEPSPEED` and rebuild the models themselves: diffusers' train_dreambooth_lora_sd3.py (v0.40.0)
rebuilds its text encoders from the base model without their LoRA adapters, loads the checkpoint's LoRA weights
into these copies and drops them; with --train_text_encoder it stops there ("'CLIPTextModelWithProjection' object
has no attribute 'peft_config'"), with or without this package, so a DeepSpeed run of it never resumed. The error
is explained where it happens; ACCEL_DS_FIX_LOAD_HOOKS=skip resumes without the hooks, for hooks that only load
model weights.
"""

import logging
import os

from .. import notices
from ..merge.proxy import name_the_models

SKIP_VARIABLE = "ACCEL_DS_FIX_LOAD_HOOKS"


def run(hooks, models, directory):
    """Run each load hook as accelerate would, with the models and the checkpoint folder."""
    if hooks and os.environ.get(SKIP_VARIABLE) == "skip":
        notices.say(f"load_state: {len(hooks)} load hook(s) of the script not run ({SKIP_VARIABLE}=skip): "
                    "DeepSpeed's checkpoint restores every weight of the prepared models", level=logging.WARNING,
                    once_key="load_hooks_skipped")
        return
    for hook in hooks:
        try:
            hook(models, directory)
        except Exception as error:
            name_the_models(error, models)
            _explain(error, hook)
            raise


def _explain(error, hook):
    code = getattr(hook, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code else ""
    script = os.path.basename(code.co_filename) if code else "the script"
    note = (
        f"accel_ds_fix: this error is in the script's load_state pre-hook {getattr(hook, '__name__', hook)}{where}. "
        "With merged models the hook gets the models themselves, as without DeepSpeed, and DeepSpeed's checkpoint "
        "restores every weight of them afterwards, over what the hook loads. "
    )
    if "peft_config" in str(error):  # the hook's DeepSpeed branch rebuilt models without their adapters
        note += (
            f"A hook that branches on `accelerator.distributed_type == DistributedType.DEEPSPEED` still takes its "
            f"DeepSpeed branch: {script}'s hook builds models there that have no LoRA adapters ('no attribute "
            "peft_config'). ")
        if script.startswith("train_dreambooth_lora_sd3"):
            note += ("diffusers' train_dreambooth_lora_sd3.py (v0.40) rebuilds its text encoders there from the base "
                     "model, to load the LoRA weights into copies it then drops. ")
    else:  # the hook's own failure, which may happen without DeepSpeed too (train_dreambooth_sd3.py's does)
        note += "If the same resume fails without DeepSpeed, the hook itself is at fault. "
    note += (f"If the hook only loads model weights, set {SKIP_VARIABLE}=skip to resume without it; a hook that "
             "restores anything else (an EMA model, a step counter) must be mended in the script.")
    if hasattr(error, "add_note"):  # Python >= 3.11: printed under the error itself
        error.add_note(note)
    else:
        notices.say(note, level=logging.ERROR)
