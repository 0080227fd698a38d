"""Peak host memory of a two-model training on the CPU against accel_ds_fix.memory's prediction.

    python tests/memory_probe.py CONFIG.json [--mixed-precision bf16] [--width 2048]

Builds a "unet" of 10 Linear(width, width) layers and a "text encoder" embedding + 2 layers, trains 3 steps
through the fix, and prints JSON: the process's resident memory before the models existed, its peak
(ru_maxrss) and the predicted peak (that baseline plus the model's prediction).
"""

import argparse
import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402
from train_two_models import single_process_env  # noqa: E402

import accel_ds_fix  # noqa: E402,F401
from accel_ds_fix.memory import model as memory_model, check as memory_check  # noqa: E402


class Unet(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(10))

    def forward(self, x, cond):
        x = x + cond
        for layer in self.layers:
            x = torch.nn.functional.silu(layer(x))
        return x


class TextEncoder(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.embed = torch.nn.Embedding(512, width)
        self.layers = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))

    def forward(self, ids):
        return self.layers(self.embed(ids)).mean(dim=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--mixed-precision", default="no")
    p.add_argument("--width", type=int, default=2048)
    args = p.parse_args()
    single_process_env()
    config = json.loads(Path(args.config).read_text())
    accelerator = Accelerator(mixed_precision=args.mixed_precision, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    # The baseline is the process with its libraries loaded and no model: DeepSpeed's engine, ZeRO and its
    # CPU Adam op are imported by prepare() otherwise, and they are no part of what the model predicts.
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])
    baseline = memory_check._rss()
    torch.manual_seed(0)
    unet, text_encoder = Unet(args.width), TextEncoder(args.width)
    optimizer = torch.optim.AdamW([*unet.parameters(), *text_encoder.parameters()], lr=1e-4)
    work = memory_check.workload_of([unet, text_encoder], optimizer)
    settings = memory_model.Settings.from_config(accelerator.state.deepspeed_plugin.deepspeed_config, args.mixed_precision)
    predicted = memory_model.predict(work, settings, "cpu", host_baseline=0)
    unet, text_encoder, optimizer = accelerator.prepare(unet, text_encoder, optimizer)
    for _ in range(3):
        ids, x = torch.randint(0, 512, (2, 8)), torch.randn(2, args.width)
        loss = unet(x, text_encoder(ids)).float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    zero = accelerator.deepspeed_engine_wrapped.engine.optimizer
    sub_groups = getattr(zero, "fp16_partitioned_groups_flat_numel", None)  # ZeRO-3 only
    print(json.dumps({"params": work.params, "baseline": baseline, "peak": peak,
                      "predicted": baseline + predicted.host, "parts": predicted.parts,
                      "largest_sub_group": max(sub_groups) if sub_groups else None,
                      "predicted_largest_sub_group": memory_model.largest_sub_group(work, settings)}))


if __name__ == "__main__":
    main()
