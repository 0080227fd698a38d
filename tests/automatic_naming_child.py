"""accelerate's automatic_checkpoint_naming with total_limit=2, two merged models: three save_state() calls, then
a killed save's folder is left with the highest number and load_state() must still pick the newest checkpoint.

    python tests/automatic_naming_child.py PROJECT_DIR     (prints one JSON line)
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, ProjectConfiguration  # noqa: E402
from scenarios import data, models_and_optimizer, single_process_env, train  # noqa: E402

project = sys.argv[1]
single_process_env()
config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=2)
acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2), project_config=config)
unet, te, opt = models_and_optimizer()
unet, te, opt, loader = acc.prepare(unet, te, opt, data())


def step(ids, latents):
    return unet(latents, te(ids))


for _ in range(3):
    train(acc, step, opt, loader, (unet, te))
    acc.save_state()
root = os.path.join(project, "checkpoints")
saved = sorted(os.listdir(root))
after_save = train(acc, step, opt, loader, (unet, te))
os.makedirs(os.path.join(root, ".accel_ds_fix-partial.checkpoint_9", "pytorch_model"))  # a killed save's
acc.load_state()
after_load = train(acc, step, opt, loader, (unet, te))
manifests = [os.path.isfile(os.path.join(root, f, "accel_ds_fix.json")) for f in saved]
print(json.dumps({"saved": saved, "manifests": manifests, "resumed_newest": after_load == after_save,
                  "losses": after_load}))
