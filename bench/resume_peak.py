"""Host memory of a zero3-nvme resume against the training's own: the shipped tier, two MLPs (bench/nvme_step.py's
--mlp), bf16 on the CPU. A first process trains and saves; a second prepares the same models, then load_state, then
trains; the peaks of each phase are read with the kernel's high-water mark reset between them (/proc/self/clear_refs)
and with a sampler of anonymous memory (RssAnon: what the OOM killer counts; the page cache of a memory-mapped
checkpoint is not).

    python bench/resume_peak.py --nvme-path /var/tmp/nvme --mlp 4096 --out resume_peak.json

Prints each phase's peaks in GiB (RssFile: pages of files mapped into the process, such as a checkpoint loaded with
mmap; the kernel drops them before it runs out of memory) and the ratio load_state / training.
"""

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
GIB = 1024**3


def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


class Peaks:
    """The high-water marks of one phase: VmHWM (resident, file pages included) and sampled RssAnon."""

    def __init__(self):
        self.anon, self.file, self.shmem, self._stop = 0, 0, 0, threading.Event()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.is_set():
            self.anon = max(self.anon, status("RssAnon"))
            self.file, self.shmem = max(self.file, status("RssFile")), max(self.shmem, status("RssShmem"))
            time.sleep(0.005)

    def end(self):
        self._stop.set()
        self._thread.join()
        self.anon = max(self.anon, status("RssAnon"))
        return {"hwm_gib": round(status("VmHWM") / GIB, 3), "anon_gib": round(self.anon / GIB, 3),
                "file_gib": round(self.file / GIB, 3), "shmem_gib": round(self.shmem / GIB, 3)}


def worker(args):
    import torch

    import accel_ds_fix  # noqa: F401
    from accel_ds_fix.memory import tiers
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from nvme_step import build_mlps
    from train_two_models import single_process_env

    single_process_env()
    config = tiers.BY_NAME["zero3-nvme"].deepspeed_config(args.nvme_path)
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    first, second = build_mlps(args.mlp)
    optimizer = torch.optim.AdamW(list(first.parameters()) + list(second.parameters()), lr=1e-6)
    phases = {}
    peaks = Peaks()
    first, second, optimizer = accelerator.prepare(first, second, optimizer)
    phases["prepare"] = peaks.end()
    if args.phase == "resume":
        peaks = Peaks()
        accelerator.load_state(args.checkpoint)
        phases["load_state"] = peaks.end()
    g = torch.Generator().manual_seed(1)
    peaks = Peaks()
    for _ in range(args.steps):
        pred = second(first(torch.randn(4, args.mlp, generator=g)))
        loss = torch.nn.functional.mse_loss(pred.float(), torch.randn(4, args.mlp, generator=g))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    phases["training"] = peaks.end()
    if args.phase == "save":
        accelerator.save_state(args.checkpoint)
    print("RESULT " + json.dumps({"phase": args.phase, "peaks": phases, "loss": loss.item()}), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--mlp", type=int, default=4096, help="width of the two 9-layer MLPs (4096: 302M parameters)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--checkpoint", default="/var/tmp/accel_ds_fix_resume_peak")
    p.add_argument("--out", default="resume_peak.json")
    p.add_argument("--phase", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        return worker(args)
    results = {}
    for phase in ("save", "resume"):
        proc = subprocess.run([sys.executable, __file__, "--phase", phase, "--nvme-path", args.nvme_path, "--mlp",
                               str(args.mlp), "--steps", str(args.steps), "--checkpoint", args.checkpoint],
                              capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{phase} failed:\n{proc.stderr[-3000:]}")
        results[phase] = json.loads(line[len("RESULT "):])
    resumed = results["resume"]["peaks"]
    for phase, peaks in resumed.items():
        print(f"{phase:<12} VmHWM {peaks['hwm_gib']:.2f} GiB   RssAnon peak {peaks['anon_gib']:.2f} GiB   (RssFile "
              f"{peaks['file_gib']:.2f}, RssShmem {peaks['shmem_gib']:.2f})")
    for key in ("hwm_gib", "anon_gib"):
        print(f"load_state / training ({key}): {resumed['load_state'][key] / resumed['training'][key]:.2f}")
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
