"""Step time of the fix against a hand-written merged module, and of DeepSpeed's CPU optimizer against its
thread count, measured interleaved in ONE process (on a shared host step times move by +-30% between runs,
so only side-by-side pairs mean something):

1. Two engines, the same SD1.5 UNet + CLIP-L weights and config (ZeRO-2 + CPU optimizer offload, fp16,
   gradient checkpointing, 512 px, batch 1): a hand-written merged module and prepare(unet, text_encoder)
   through the fix. Steps alternate A B A B ...; the median ratio fix/hand over the pairs, with its min-max.
2. On the fix's engine, steps cycle through OpenMP thread counts (all cores, 8, 4, 1: the count torchrun gives
   each of several processes unless OMP_NUM_THREADS is set), set in every OpenMP runtime the process has
   loaded; the median step time per count and its ratio to all cores.

    python bench/sd15_interleaved.py --pairs 8 --out interleaved.json
    python bench/sd15_interleaved.py --tiny --pairs 3       # a smoke test on the CPU

Under a launcher (one process per GPU, data parallel) every process runs the same comparison on its own batch;
the main process reports, and "all cores" means the process's share of them. Scaling from 1 to 2 GPUs: run it
plainly and under `torchrun --nproc_per_node 2` (leave OMP_NUM_THREADS unset there to see the fix's thread warning
fire, or set it to the cores per process) and compare the medians: a step of N processes trains N samples.
"""

import argparse
import ctypes
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def set_openmp_threads(n):
    """torch's own threads, and every OpenMP runtime loaded (DeepSpeed's JIT ops link the system libgomp,
    torch ships its own)."""
    import torch

    torch.set_num_threads(n)
    with open("/proc/self/maps") as f:
        libraries = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    for path in libraries:
        try:
            ctypes.CDLL(path).omp_set_num_threads(n)
        except (OSError, AttributeError):
            pass


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--thread-cycles", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default="interleaved.json")
    args = p.parse_args()

    import torch

    import accel_ds_fix  # noqa: F401
    from accel_ds_fix.launch import cpu_threads
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from sd15_6gb import build_models, hand_merged

    cuda = torch.cuda.is_available() and not args.tiny
    precision, half = ("fp16", torch.float16) if cuda else ("bf16", torch.bfloat16)
    if "RANK" not in os.environ:  # run plainly: one process; under torchrun the launcher set these
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0",
                              WORLD_SIZE="1", LOCAL_RANK="0")
    if not cuda:  # the CPU has no NCCL: several processes talk through gloo
        from accelerate import PartialState

        PartialState(backend="gloo")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    plugin = DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu", gradient_clipping=1.0)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1  # no dataloader is prepared
    hand_acc = Accelerator(mixed_precision=precision, deepspeed_plugin=plugin)
    fix_acc = Accelerator(mixed_precision=precision)  # a second Accelerator shares the first one's DeepSpeed plugin

    hand_unet, hand_te = build_models(args.tiny)
    fix_unet, fix_te = build_models(args.tiny)  # the same seed: the same weights

    hand_opt = torch.optim.AdamW([*hand_unet.parameters(), *hand_te.parameters()], lr=1e-6)
    fix_opt = torch.optim.AdamW([*fix_unet.parameters(), *fix_te.parameters()], lr=1e-6)
    hand, hand_opt = hand_acc.prepare(hand_merged(hand_unet, hand_te, "cuda" if cuda else "cpu", half), hand_opt)
    fix_unet, fix_te, fix_opt = fix_acc.prepare(fix_unet, fix_te, fix_opt)

    def fix_forward(ids, noisy, t):
        with fix_acc.autocast():
            return fix_unet(noisy, t, fix_te(ids)[0]).sample

    size, vocab = (8, 1000) if args.tiny else (64, 49408)
    g = torch.Generator().manual_seed(1 + rank)  # each process its own sample, as a data-parallel shard
    batch = (torch.randint(0, vocab, (1, 77), generator=g), torch.randn(1, 4, size, size, generator=g),
             torch.randn(1, 4, size, size, generator=g), torch.randint(0, 1000, (1,), generator=g))
    device = hand_acc.device
    ids, latents, noise, t = (x.to(device) for x in batch)

    def step(acc, forward, optimizer):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(forward(ids, latents + noise, t).float(), noise.float())
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, loss.item()

    for _ in range(2):  # warm-up
        step(hand_acc, hand, hand_opt)
        step(fix_acc, fix_forward, fix_opt)
    pairs = []
    for _ in range(args.pairs):
        (h, hl), (f, fl) = step(hand_acc, hand, hand_opt), step(fix_acc, fix_forward, fix_opt)
        pairs.append({"hand_s": h, "fix_s": f, "hand_loss": hl, "fix_loss": fl})
    ratios = [pr["fix_s"] / pr["hand_s"] for pr in pairs]
    result = {"pairs": pairs, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
              "ratio_max": max(ratios), "hand_median_s": statistics.median(pr["hand_s"] for pr in pairs),
              "fix_median_s": statistics.median(pr["fix_s"] for pr in pairs)}
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} process(es); fix / hand-written merge over {args.pairs} interleaved pairs: median "
        f"{result['ratio_median']:.3f} (min {result['ratio_min']:.3f}, max {result['ratio_max']:.3f}); "
        f"hand {result['hand_median_s']:.3f} s, fix {result['fix_median_s']:.3f} s", flush=True)

    cores = cpu_threads.cores_per_process()  # this process's share of the machine's cores
    if args.thread_cycles:  # 0: only the fix / hand comparison
        result["threads"] = thread_cycles(args, step, fix_acc, fix_forward, fix_opt, cores, say)
    result["processes"] = world
    if rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))
    fix_acc.end_training()


def thread_cycles(args, step, acc, forward, optimizer, cores, say):
    """Steps on the fix's engine cycling through OpenMP thread counts: the median per count, its ratio to all."""
    counts = sorted({cores, min(8, cores), min(4, cores), 1}, reverse=True)
    times = {n: [] for n in counts}
    for _ in range(args.thread_cycles):
        for n in counts:
            set_openmp_threads(n)
            step(acc, forward, optimizer)  # one step to settle the new thread pool
            times[n].append(step(acc, forward, optimizer)[0])
    set_openmp_threads(cores)
    medians = {n: statistics.median(v) for n, v in times.items()}
    for n in counts:
        say(f"{n:>3} OpenMP threads: median {medians[n]:.3f} s/step, {medians[n] / medians[cores]:.2f}x the "
            f"{cores}-thread step ({args.thread_cycles} cycles)", flush=True)
    return {str(n): {"median_s": medians[n], "times": times[n], "ratio_to_all": medians[n] / medians[cores]}
            for n in counts}


if __name__ == "__main__":
    main()
