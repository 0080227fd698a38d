"""A two-model training under ZeRO-3 with the optimizer on NVMe, large enough that DeepSpeed swaps its sub groups.

    python tests/nvme_probe.py SWAP_FOLDER [--gas 2] [--steps 4] [--width 512]

Prints JSON: the losses, the bytes the process read from and wrote to storage during the steps (/proc/self/io,
which counts DeepSpeed's direct I/O), the optimizer steps taken, and which swap files exist after the run
(DeepSpeed's own gradient swap leaves ``*_gradient_*`` files; with the fix's patch there are none).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, set_seed  # noqa: E402
from memory_probe import TextEncoder, Unet  # noqa: E402
from train_two_models import single_process_env  # noqa: E402

import accel_ds_fix  # noqa: E402,F401


def io_bytes():
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("swap_folder")
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="batches")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--pipelined", action="store_true", help="the shipped tier's way: pipeline_read and pipeline_write")
    args = p.parse_args()
    single_process_env()
    set_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": args.gas, "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3, "sub_group_size": 4 * args.width * args.width,  # several sub groups, each swapped
            "offload_optimizer": {"device": "nvme", "nvme_path": args.swap_folder, "buffer_count": 4,
                                  "fast_init": False},
        },
        "aio": {"block_size": 262144, "queue_depth": 8, "intra_op_parallelism": 1},
    }
    if args.pipelined:
        config["zero_optimization"]["offload_optimizer"].update(buffer_count=12, pipeline_read=True,
                                                                pipeline_write=True)
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=args.gas,
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    unet, text_encoder = Unet(args.width), TextEncoder(args.width)
    optimizer = torch.optim.AdamW(list(unet.parameters()) + list(text_encoder.parameters()), lr=1e-3)
    unet, text_encoder, optimizer = accelerator.prepare(unet, text_encoder, optimizer)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 512, (2, 4), generator=generator), torch.randn(2, args.width, generator=generator))
               for _ in range(args.steps)]
    losses, optimizer_steps = [], 0
    read0, write0 = io_bytes()
    for ids, target in batches:
        with accelerator.accumulate(unet, text_encoder):
            out = unet(target.to(torch.bfloat16), text_encoder(ids))
            loss = torch.nn.functional.mse_loss(out.float(), target)
            accelerator.backward(loss)
            optimizer_steps += accelerator.sync_gradients
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    read1, write1 = io_bytes()
    trained = sum(p.ds_numel for p in accelerator.unwrap_model(unet).parameters()) + sum(
        p.ds_numel for p in accelerator.unwrap_model(text_encoder).parameters())
    swap_files = sorted(f.name for f in Path(args.swap_folder).rglob("*.swp"))
    # What the host still holds of each swapped sub group between steps: its master weights and Adam states
    # should be on the disk only.
    zero = accelerator.deepspeed_engine_wrapped.engine.optimizer
    held = [sum(t.numel() for t in [flat, *(v for v in zero.optimizer.state.get(flat, {}).values() if torch.is_tensor(v))])
            for i, flat in enumerate(zero.fp32_partitioned_groups_flat) if zero._swappable_optimizer_subgroup(i)]
    print(json.dumps({"losses": losses, "read_bytes": read1 - read0, "write_bytes": write1 - write0,
                      "optimizer_steps": optimizer_steps, "trained": trained, "swap_files": swap_files,
                      "swapped_sub_groups": len(held), "elements_held_of_swapped_sub_groups": sum(held),
                      "largest_sub_group": max(zero.fp16_partitioned_groups_flat_numel)}))


if __name__ == "__main__":
    main()
