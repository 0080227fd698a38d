"""Host memory of a zero3-nvme resume against the training's own: the shipped tier, two MLPs (bench/nvme_step.py's
--mlp), bf16 on the CPU, or (--model sd15) SD1.5's UNet and CLIP-L text encoder at 512 px in fp16 on a GPU capped at
6 GiB (bench/sd15_6gb.py's models). A first process trains and saves; a second prepares the same models, then load_state, then
trains; the peaks of each phase are read with the kernel's high-water mark reset between them (/proc/self/clear_refs)
and with a sampler of anonymous memory (RssAnon: what the OOM killer counts; the page cache of a memory-mapped
checkpoint is not).

    python bench/resume_peak.py --nvme-path /var/tmp/nvme --mlp 4096 --out resume_peak.json
    python bench/resume_peak.py --nvme-path /var/tmp/nvme --model sd15 --out resume_peak_sd15.json   # on a GPU

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


def build(args):
    """(models, a function of the prepared models giving one step's loss, precision) for --model."""
    import torch

    if args.model == "mlp":
        from nvme_step import build_mlps

        first, second = build_mlps(args.mlp)
        g = torch.Generator().manual_seed(1)

        def loss(first, second):
            pred = second(first(torch.randn(4, args.mlp, generator=g)))
            return torch.nn.functional.mse_loss(pred.float(), torch.randn(4, args.mlp, generator=g))

        return (first, second), loss, "bf16"
    from sd15_6gb import build_models

    # Without a GPU: bf16, 8x8 latents, and SD1.5's layout in tiny widths (a smoke test) or, with --full-size, in
    # its real widths: the optimizer states and so the resume's memory are those of SD1.5, the step is cheap.
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_per_process_memory_fraction(6 * GIB / torch.cuda.get_device_properties(0).total_memory)
    full = cuda or args.full_size
    unet, text_encoder = build_models(tiny=not full)
    device, dtype = ("cuda", torch.float16) if cuda else ("cpu", torch.bfloat16)
    size, vocab = (64 if cuda else 8, 49408 if full else 1000)
    g = torch.Generator().manual_seed(1)

    def loss(unet, text_encoder):
        ids = torch.randint(0, vocab, (1, 77), generator=g).to(device)
        latents, noise = torch.randn(2, 1, 4, size, size, generator=g).to(device)
        t = torch.randint(0, 1000, (1,), generator=g).to(device)
        with torch.autocast(device, dtype=dtype):
            pred = unet(latents + noise, t, text_encoder(ids)[0]).sample
        return torch.nn.functional.mse_loss(pred.float(), noise.float())

    return (unet, text_encoder), loss, "fp16" if cuda else "bf16"


def worker(args):
    import torch

    import accel_ds_fix  # noqa: F401
    from accel_ds_fix.memory import check, model, tiers
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from train_two_models import single_process_env

    single_process_env()
    config = tiers.BY_NAME[args.tier].deepspeed_config(args.nvme_path)
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    models, step_loss, precision = build(args)
    accelerator = Accelerator(mixed_precision=precision, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    optimizer = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=1e-6)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = model.Settings.from_config(config, precision)
    predicted = model.predict(check.workload_of(models, optimizer), settings, device, host_baseline=0)
    phases = {"before_prepare_gib": round(status("VmRSS") / GIB, 3)}
    peaks = Peaks()
    *models, optimizer = accelerator.prepare(*models, optimizer)
    phases["prepare"] = peaks.end()
    if args.phase == "resume":
        peaks = Peaks()
        accelerator.load_state(args.checkpoint)
        phases["load_state"] = peaks.end()
        phases["after_load_anon_gib"] = round(status("RssAnon") / GIB, 3)
        if args.trim:  # what glibc keeps of the memory the load freed
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
            phases["after_trim_anon_gib"] = round(status("RssAnon") / GIB, 3)
    peaks = Peaks()
    for _ in range(args.steps):
        loss = step_loss(*models)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    phases["training"] = peaks.end()
    if args.phase == "save":
        peaks = Peaks()
        accelerator.save_state(args.checkpoint)
        phases["save_state"] = peaks.end()
    # the process's peak: the largest phase's (clear_refs resets VmHWM, and with it ru_maxrss, at each phase)
    phases["ru_maxrss_gib"] = max(v["hwm_gib"] for v in phases.values() if isinstance(v, dict))
    phases["predicted_host_gib_without_baseline"] = round(predicted.host / GIB, 3)
    phases["predicted_resume_host_gib_without_baseline"] = round(predicted.host_resume / GIB, 3)
    print("RESULT " + json.dumps({"phase": args.phase, "peaks": phases, "loss": loss.item()}), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--model", choices=("mlp", "sd15"), default="mlp")
    p.add_argument("--tier", default="zero3-nvme", help="a shipped tier (accel_ds_fix.memory.tiers)")
    p.add_argument("--full-size", action="store_true", help="--model sd15 on the CPU: SD1.5's real widths")
    p.add_argument("--trim", action="store_true", help="after load_state, return glibc's freed memory (malloc_trim)")
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
        proc = subprocess.run([sys.executable, __file__, "--phase", phase, "--nvme-path", args.nvme_path, "--model",
                               args.model, "--tier", args.tier, *(["--full-size"] if args.full_size else []), "--mlp",
                               str(args.mlp), "--steps", str(args.steps), "--checkpoint", args.checkpoint],
                              capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{phase} failed:\n{proc.stderr[-3000:]}")
        results[phase] = json.loads(line[len("RESULT "):])
    resumed = results["resume"]["peaks"]
    print(f"process before prepare(): {resumed['before_prepare_gib']:.2f} GiB; peak VmHWM: saving run "
          f"{results['save']['peaks']['ru_maxrss_gib']:.2f}, resumed run {resumed['ru_maxrss_gib']:.2f} GiB; the memory "
          f"model's training peak above the process: {resumed['predicted_host_gib_without_baseline']:.2f} GiB")
    print(f"losses: saving run {results['save']['loss']:.7f}, resumed run {results['resume']['loss']:.7f}")
    for phase, peaks in resumed.items():
        if not isinstance(peaks, dict):
            continue
        print(f"{phase:<12} VmHWM {peaks['hwm_gib']:.2f} GiB   RssAnon peak {peaks['anon_gib']:.2f} GiB   (RssFile "
              f"{peaks['file_gib']:.2f}, RssShmem {peaks['shmem_gib']:.2f})")
    for key in ("hwm_gib", "anon_gib"):
        print(f"load_state / training ({key}): {resumed['load_state'][key] / resumed['training'][key]:.2f}")
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
