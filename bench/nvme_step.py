"""The NVMe tier's step as shipped (pipelined swaps, the fix's gradients in host memory) against the same one sub
group at a time and against DeepSpeed's own gradient swap, SD1.5
(UNet + CLIP-L text encoder, random weights, 512 px, batch 1, fp16, gradient checkpointing, AdamW lr 1e-6, the
card capped at 6 GiB), each run in its own process, the modes interleaved: host, serial, disk, host, ...

    python bench/nvme_step.py --nvme-path /var/tmp/nvme --rounds 2 --steps 4 --out nvme.json
    python bench/nvme_step.py --tiny --nvme-path /var/tmp/nvme --rounds 1 --steps 2 --out nvme.json  # CPU smoke test
    python bench/nvme_step.py --mlp 4096 --nvme-path /var/tmp/nvme --rounds 3 --steps 4  # CPU: 302M parameters

Per run: losses, seconds per step, bytes read and written per step (/proc/self/io, which counts DeepSpeed's
direct I/O), peaks, and ZeRO-3's swap and step timers (those wall_clock_breakdown prints). Prints the medians side by side and their
ratios.
"""

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
GIB = 1024**3
TIMER = re.compile(r"(optimizer_[a-z_]+): ([0-9.]+)")


def io_bytes():
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def worker(args):
    import torch

    import accel_ds_fix  # noqa: F401
    from accel_ds_fix.memory import tiers
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from sd15_6gb import build_models
    from train_two_models import single_process_env

    cuda = torch.cuda.is_available() and not args.tiny
    if args.deterministic:  # cuDNN's and cuBLAS's fastest kernels may sum in another order from run to run
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True, warn_only=True)
    if cuda:
        torch.cuda.set_per_process_memory_fraction(6 * GIB / torch.cuda.get_device_properties(0).total_memory)
    single_process_env()
    config = tiers.BY_NAME["zero3-nvme"].deepspeed_config(args.nvme_path)
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    if args.tiny:  # sub groups above aio's 1 MiB block, so that they are swapped
        config["zero_optimization"]["sub_group_size"] = 300000
    if args.mode != "host":  # the sub groups kept in RAM (nvme/sub_groups_in_ram.py) are the shipped tier's only
        config.pop("accel_ds_fix", None)
    if args.mode in ("serial", "disk"):  # the tier before pipelining: one sub group at a time, 50M elements each
        config["zero_optimization"]["offload_optimizer"].update(buffer_count=4, pipeline_read=False,
                                                                pipeline_write=False)
        if not args.tiny:
            config["zero_optimization"]["sub_group_size"] = 50000000
    if args.sub_group_size and args.mode in ("host", "noram"):
        config["zero_optimization"]["sub_group_size"] = args.sub_group_size
    if args.mode == "ram":  # the reference: the same ZeRO-3 layout with the optimizer in host memory, no disk
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    precision = "fp16" if cuda else "bf16"
    accelerator = Accelerator(mixed_precision=precision, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    unet, text_encoder = build_mlps(args.mlp) if args.mlp else build_models(args.tiny)
    params = list(unet.parameters()) + list(text_encoder.parameters())
    trained = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    unet, text_encoder, optimizer = accelerator.prepare(unet, text_encoder, optimizer)
    # ZeRO-3's own step timers (swap in, step, swap out per sub group), logged each step. The engine's
    # wall_clock_breakdown would time forward and backward too, but trips over gradient checkpointing's
    # re-entrant backward ("bwd_microstep timer has already been started").
    from deepspeed.utils.timer import SynchronizedWallClockTimer

    accelerator.deepspeed_engine_wrapped.engine.optimizer.timers = SynchronizedWallClockTimer()
    g = torch.Generator().manual_seed(1)
    size, vocab = (8, 1000) if args.tiny else (64, 49408)
    device = accelerator.device
    steps = []
    for step in range(args.steps + 2):  # 2 warm-up steps
        ids = torch.randint(0, vocab, (1, 77), generator=g).to(device)
        latents, noise = (torch.randn(1, 4, size, size, generator=g).to(device) for _ in range(2))
        t = torch.randint(0, 1000, (1,), generator=g).to(device)
        read0, write0 = io_bytes()
        started = time.perf_counter()
        with accelerator.autocast():
            if args.mlp:  # a random input to a random target: losses about 1, moving with each step
                pred = unet(text_encoder(torch.randn(4, args.mlp, generator=g).to(device)))
                noise = torch.randn(4, args.mlp, generator=g).to(device)
            else:
                hidden = text_encoder(ids)[0]
                pred = unet(latents + noise, t, hidden).sample
        loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        read1, write1 = io_bytes()
        steps.append({"loss": loss.item(), "seconds": time.perf_counter() - started,
                      "read_bytes": read1 - read0, "written_bytes": write1 - write0})
    from accel_ds_fix.nvme import sub_groups_in_ram

    zero = accelerator.deepspeed_engine_wrapped.engine.optimizer
    kept = sub_groups_in_ram.kept_sub_groups(zero)
    result = {"mode": args.mode, "trained": trained, "steps": steps, "sub_groups": len(zero.fp16_groups),
              "sub_groups_in_ram": kept, "elements_in_ram": sum(int(zero.fp16_partitioned_groups_flat_numel[i])
                                                               for i in kept),
              "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    if cuda:
        result.update(gpu_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                      gpu_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
    print("RESULT " + json.dumps(result), flush=True)


def build_mlps(width):
    """Two models of 9 Linear(width, width) layers each: where the optimizer step, not forward and backward, sets
    the step time (a CPU-only machine: 302M parameters at width 4096)."""
    import torch

    torch.manual_seed(0)
    return tuple(torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                       for _ in range(9))) for _ in range(2))


def timers(log):
    """DeepSpeed's wall_clock_breakdown lines: per timer, the milliseconds of each logged step."""
    found = {}
    for name, ms in TIMER.findall(log):
        found.setdefault(name, []).append(float(ms))
    return found


def summary(run):
    timed = run["steps"][2:]
    trained = run["trained"]
    return {
        "s_per_step": statistics.median(s["seconds"] for s in timed),
        "read_bytes_per_param": statistics.median(s["read_bytes"] for s in timed) / trained,
        "written_bytes_per_param": statistics.median(s["written_bytes"] for s in timed) / trained,
        "host_peak_gib": run["host_peak_gib"],
        "gpu_reserved_gib": run.get("gpu_reserved_gib"),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps per run, after 2 warm-up steps")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--mlp", type=int, default=0, metavar="WIDTH",
                   help="two 9-layer MLPs of this width instead of SD1.5 (a CPU-only machine: 4096)")
    p.add_argument("--sub-group-size", type=int, default=0, help="the host mode's sub_group_size (the tier's: 25M)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic GPU kernels, so that runs can be compared bit for bit")
    p.add_argument("--out", default="nvme_step.json")
    p.add_argument("--modes", default="host,serial,disk",
                   help="host: the shipped tier (pipelined swaps, the fix's gradients in RAM, its last sub groups "
                        "in RAM within accel_ds_fix.nvme_optimizer_ram_gib); noram: the same, every sub group on the "
                        "disk; serial: that, one "
                        "sub group at a time (the tier before pipelining); disk: serial with DeepSpeed's own gradient "
                        "swap (ACCEL_DS_FIX_NVME_GRADIENTS=disk), what DeepSpeed does alone; ram: the optimizer in "
                        "RAM instead of NVMe (reference)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="host", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    runs = []
    for round_ in range(args.rounds):
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--nvme-path", args.nvme_path,
                   "--steps", str(args.steps)]
            cmd += (["--tiny"] if args.tiny else []) + (["--deterministic"] if args.deterministic else [])
            cmd += ["--mlp", str(args.mlp)] if args.mlp else []
            cmd += ["--sub-group-size", str(args.sub_group_size)] if args.sub_group_size else []
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "ACCEL_DS_FIX_NVME_GRADIENTS": "disk" if mode == "disk" else "host"})
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{mode} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            run = json.loads(line[len("RESULT "):])
            run.update(round=round_, timers=timers(proc.stdout + proc.stderr), summary=None)
            run["summary"] = summary(run)
            runs.append(run)
            s = run["summary"]
            if run.get("sub_groups_in_ram"):
                print(f"  {len(run['sub_groups_in_ram'])} of {run['sub_groups']} sub groups in RAM, "
                      f"{run['elements_in_ram'] / 1e6:.1f}M parameters", flush=True)
            print(f"round {round_} {mode:<5} {s['s_per_step']:6.2f} s/step, read {s['read_bytes_per_param']:5.1f} "
                  f"B/param, written {s['written_bytes_per_param']:5.1f} B/param, host {s['host_peak_gib']:.2f} GiB"
                  + (f", GPU reserved {s['gpu_reserved_gib']:.2f} GiB" if s["gpu_reserved_gib"] else ""), flush=True)
            # each run's detail as it ends, and the report so far: a run cut off later keeps what came before
            swaps = {name: statistics.median(ms[-args.steps:]) / 1000 for name, ms in run["timers"].items()}
            print(f"  s per step {[round(x['seconds'], 2) for x in run['steps']]}, losses "
                  f"{[round(x['loss'], 7) for x in run['steps']]}, timers (median s) "
                  f"{ {k: round(v, 2) for k, v in sorted(swaps.items())} }", flush=True)
            Path(args.out).write_text(json.dumps({"runs": runs}, indent=1))
    modes = args.modes.split(",")
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in modes}
    losses = {m: [[s["loss"] for s in r["steps"]] for r in rs] for m, rs in by_mode.items()}
    medians = {m: {k: statistics.median(r["summary"][k] for r in rs) for k in ("s_per_step", "read_bytes_per_param",
                                                                             "written_bytes_per_param", "host_peak_gib")}
               for m, rs in by_mode.items()}
    for m in modes:
        print(f"{m:<5} losses of the first run: {', '.join(f'{x:.7f}' for x in losses[m][0])}")
    equal = all(run == losses[modes[0]][0] for ls in losses.values() for run in ls)
    print(f"losses equal in every run: {equal}")
    for a, b in (("host", "disk"), ("noram", "disk"), ("host", "noram"), ("serial", "disk"), ("host", "serial")):
        if a in medians and b in medians:
            moved = {m: medians[m]["read_bytes_per_param"] + medians[m]["written_bytes_per_param"] for m in (a, b)}
            print(f"step time {a}/{b}: {medians[a]['s_per_step'] / medians[b]['s_per_step']:.2f}x; bytes a parameter "
                  f"moved through the disk per step: {a} {moved[a]:.1f}, {b} {moved[b]:.1f}; host peak {a} "
                  f"{medians[a]['host_peak_gib']:.2f} GiB, {b} {medians[b]['host_peak_gib']:.2f} GiB")
    Path(args.out).write_text(json.dumps({"runs": runs, "medians": medians, "losses_equal": equal}, indent=1))


if __name__ == "__main__":
    main()
