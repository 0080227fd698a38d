"""A two-model training under ZeRO-3 with the optimizer on NVMe, large enough that DeepSpeed swaps its sub groups.

    python tests/nvme_probe.py SWAP_FOLDER [--gas 2] [--steps 4] [--width 512] [--pipelined]
        [--save-state DIR --save-after N] [--resume DIR --first-step N] [--kill-at-swap-out N]

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


def kill_at_swap_out(count):
    """The test's kill -9 in the middle of training: at the ``count``-th sub group swapped out once training has
    started (pipelined: its write still in flight, the next sub group being read). Returns the switch that
    starts the count (swaps of start-up and load_state are not counted)."""
    import os
    import signal

    from deepspeed.runtime.swap_tensor import partitioned_optimizer_swapper, pipelined_optimizer_swapper

    calls, armed = [], []

    def wrap(cls):
        original = cls.swap_out_optimizer_state

        def swap_out(self, *a, **kw):
            result = original(self, *a, **kw)
            if armed:
                calls.append(1)
                if len(calls) == count:
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            return result

        cls.swap_out_optimizer_state = swap_out

    wrap(pipelined_optimizer_swapper.PipelinedOptimizerSwapper)
    wrap(partitioned_optimizer_swapper.PartitionedOptimizerSwapper)
    return lambda: armed.append(True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("swap_folder")
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="batches")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--pipelined", action="store_true", help="the shipped tier's way: pipeline_read and pipeline_write")
    p.add_argument("--ram-gib", type=float, default=None, help="accel_ds_fix.nvme_optimizer_ram_gib in the config")
    p.add_argument("--save-state", help="save_state into this folder after --save-after batches")
    p.add_argument("--save-after", type=int, default=0)
    p.add_argument("--resume", help="load_state from this folder first, and skip --first-step batches")
    p.add_argument("--first-step", type=int, default=0)
    p.add_argument("--kill-at-swap-out", type=int, default=0,
                   help="SIGKILL this process at the N-th sub group swapped out (its write submitted, not done)")
    args = p.parse_args()
    start_counting = kill_at_swap_out(args.kill_at_swap_out) if args.kill_at_swap_out else (lambda: None)
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
    if args.ram_gib is not None:
        config["accel_ds_fix"] = {"nvme_optimizer_ram_gib": args.ram_gib}
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
    if args.resume:
        accelerator.load_state(args.resume)
    losses, optimizer_steps = [], 0
    start_counting()
    read0, write0 = io_bytes()
    for number, (ids, target) in enumerate(batches[args.first_step:], args.first_step + 1):
        with accelerator.accumulate(unet, text_encoder):
            out = unet(target.to(torch.bfloat16), text_encoder(ids))
            loss = torch.nn.functional.mse_loss(out.float(), target)
            accelerator.backward(loss)
            optimizer_steps += accelerator.sync_gradients
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if args.save_state and number == args.save_after:
            accelerator.save_state(args.save_state)
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
                      "largest_sub_group": max(zero.fp16_partitioned_groups_flat_numel),
                      "sub_groups": len(zero.fp16_groups),
                      "sub_groups_in_ram": [i for i in range(len(zero.fp16_groups)) if not zero._swappable_optimizer_subgroup(i)],
                      "sub_group_sizes": [int(n) for n in zero.fp16_partitioned_groups_flat_numel]}))


if __name__ == "__main__":
    main()
