"""The command line: `python -m accel_ds_fix` reports whether the fix is active here; `python -m accel_ds_fix
plan` says which DeepSpeed config fits a model on a machine and writes it; `python -m accel_ds_fix build-ops`
compiles DeepSpeed's ops ahead of the first run; `python -m accel_ds_fix get-libaio` unpacks libaio without root.
Only calls the library."""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile

from ..deepspeed_config import section
from ..memory import advice, model as memory_model, tiers
from ..nvme import disk_speed, prerequisites as nvme_prerequisites
from ..ops import builds, libaio
from ..streaming import copy_speed
from . import report

GIB = memory_model.GIB


def _positive(parse, what, examples):
    """An argparse type: ``parse(text)`` must be more than 0; the text itself goes on (the library parses it)."""

    def check(text):
        try:
            value = parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be more than 0 (examples: {examples})")
        return text

    return check


def _at_most(check, parse, limit, what):
    """An argparse type: ``check``, then no more than ``limit`` (larger is a typo, and would not plan)."""

    def bounded(text):
        check(text)
        if parse(text) > limit:
            raise argparse.ArgumentTypeError(f"{text!r}: {what}")
        return text

    return bounded


# --params, --trainable: 10 trillion is far beyond what DeepSpeed trains on one machine (16 bytes a parameter)
_parameter_count = _at_most(_positive(advice.parse_count, "a parameter count", "983M, 1.1B"), advice.parse_count,
                            10**13, "more parameters than any machine trains (at most 10000B); examples: 983M, 12B")
_sized = _at_most(_positive(advice.parse_bytes, "a memory size", "6GiB, 15GB"), advice.parse_bytes, 2**50,
                  "larger than any machine's memory (at most 1024TiB); examples: 6GiB, 15GB")


def _memory_size(text):
    """argparse type of --gpu-memory, --host-memory, --activations: a size with its unit (a bare number would be
    read as bytes: `--gpu-memory 6` planned for a card of 6 bytes)."""
    if re.fullmatch(r"\s*[0-9.]+\s*", text):
        raise argparse.ArgumentTypeError(f"{text!r} has no unit: write {text.strip()}GiB (or {text.strip()}GB, "
                                         f"{text.strip()}g; MiB, MB, m and TiB, TB, t work too)")
    return _sized(text)


def _at_least(minimum, what):
    """argparse type of --gpu-memory and --host-memory: a size, more than what the plan keeps aside."""

    def check(text):
        text = _memory_size(text)
        if advice.parse_bytes(text) <= minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is less than the {minimum / GIB:g} GiB the plan keeps for "
                                             f"{what}: give the whole memory, e.g. 6GiB")
        return text

    return check


def _nvme_folder(text):
    """argparse type of --nvme-path: a folder that exists and takes files (measured inside; nothing is made)."""
    path = os.path.abspath(os.path.expanduser(text))
    if not os.path.isdir(path):
        what = "is a file, not a folder" if os.path.exists(path) else f"does not exist (make it first: mkdir -p {text})"
        raise argparse.ArgumentTypeError(f"{text} {what}: give the folder on the NVMe disk DeepSpeed should swap to")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        mount = nvme_prerequisites.filesystem_of(path)
        kind = f" (a {mount[1]} filesystem)" if mount else ""
        raise argparse.ArgumentTypeError(f"cannot write files in {text}{kind}: {exc.strerror}; give a folder on the "
                                         "NVMe disk DeepSpeed should swap to") from None
    return text


def _whole_number(text):
    if not text.strip().isdigit():
        raise ValueError(f"{text!r} is not a whole number")
    return int(text)


def _positive_int(text):  # --num-processes, --steps
    return _whole_number(_positive(_whole_number, "a whole number", "1, 1600")(text))


def _writable_folder(text):
    """argparse type of --write: a folder that can be written, or made (its nearest existing parent checked before
    the plan, so a typo costs no measurement; what only the write can tell, /proc, is one line from _write)."""
    existing = os.path.abspath(os.path.expanduser(text))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise argparse.ArgumentTypeError(f"cannot write into {text}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {text}: {existing} is not writable by this user; "
                                         "give a folder you can write (it is made where missing)")
    return text


def _plan_parser(sub):
    p = sub.add_parser("plan", help="which shipped DeepSpeed config fits a model on a machine",
                       description="Predict each shipped tier's GPU, host and NVMe needs, say which fit, recommend one.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_parameter_count,
                      help="parameters passed to prepare(), e.g. 983M (SD1.5 UNet + text encoder)")
    what.add_argument("--model", help="a diffusers pipeline folder (Flux, SD3/SD3.5, SDXL, SD1.x: its denoiser and the "
                                      "text encoders the scripts train are counted, and what they keep on the card), "
                                      "a transformers/diffusers model folder, or a .safetensors file")
    p.add_argument("--trainable", type=_parameter_count, help="trainable parameters, if fewer than all (default: all)")
    p.add_argument("--no-text-encoder", action="store_true",
                   help="with a pipeline --model: the text encoders stay frozen (the scripts without "
                        "--train_text_encoder; then they pass one model to prepare() and need no fix)")
    p.add_argument("--lora-rank", type=_positive_int, metavar="R",
                   help="with a pipeline --model: a LoRA of rank R, as the scripts' --rank (the base frozen)")
    p.add_argument("--grid", action="store_true",
                   help="the recommended tier for 8, 12, 16 and 24 GB cards with 16, 32 and 64 GB of RAM, instead of "
                        "this machine")
    p.add_argument("--gpu-memory", type=_at_least(advice.GPU_RESERVE, "the CUDA context and display"),
                   help="the card's memory, e.g. 6GiB (default: detected)")
    p.add_argument("--host-memory", type=_at_least(advice.HOST_RESERVE, "the system and desktop"),
                   help="the machine's RAM, e.g. 16GiB (default: detected)")
    p.add_argument("--activations", type=_memory_size,
                   help="activation memory at the peak (default: the pipeline family's estimate at its usual "
                        "resolution, batch 1, gradient checkpointing; else 0.42GiB, SD1.5 at 512 px)")
    p.add_argument("--mixed-precision", default="fp16", choices=["fp16", "bf16", "no"])
    p.add_argument("--num-processes", type=_positive_int, default=1, help="data-parallel processes (GPUs)")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument("--write", metavar="DIR", type=_writable_folder,
                   help="write the recommended (or --tier) config pair into DIR")
    p.add_argument("--tier", choices=[t.name for t in tiers.TIERS], help="the tier to write instead")
    p.add_argument("--nvme-path", type=_nvme_folder,
                   help="folder on an NVMe disk for the zero3-nvme tier's optimizer states (default "
                        f"{tiers.DEFAULT_NVME_PATH}); given, its read and write speed is measured (a few seconds) "
                        "and the tier's time a step predicted")
    p.add_argument("--steps", type=_positive_int,
                   help="optimizer steps of the run (kohya's --max_train_steps): hours and bytes written to the SSD "
                        "for the NVMe tier")
    p.add_argument("--h2d-gbps", type=float,
                   help="the card's copy bandwidth from pinned host memory, GB/s, for the zero2-stream tier's step "
                        "(default: measured on this machine's card where --gpu-memory is not given, else "
                        f"{advice.DEFAULT_H2D_GBPS:g}, a PCIe 4.0 x16 slot)")
    p.add_argument("--resolution", type=_positive_int,
                   help="with a pipeline --model: the training resolution (the scripts' --resolution), for the "
                        "activation estimate, which grows with its square (default: the family's usual one: 512 "
                        "for Flux and SD3, 1024 for SDXL)")
    p.add_argument("--compute-seconds", type=float,
                   help="seconds of a training step's computation: for zero3-nvme the step outside the disk "
                        f"(forward, backward, CPU Adam; default {disk_speed.DEFAULT_COMPUTE_SECONDS}: SD1.5 at 512 px "
                        "on a datacenter GPU with a 16-core host; a laptop GPU is slower); for zero2-stream the same "
                        "script's step on a card that holds the whole model, from which the plan gives the streamed "
                        "step")


def _h2d_gbps(args):
    """--h2d-gbps, else this machine's card measured where the plan is for it, else the assumed PCIe 4.0 x16."""
    if args.h2d_gbps:
        return args.h2d_gbps, "--h2d-gbps"
    if not args.gpu_memory and not args.grid:
        measured = copy_speed.measure_gbps()
        if measured:
            return round(measured, 1), "measured on this machine's card"
    return advice.DEFAULT_H2D_GBPS, "assumed: a PCIe 4.0 x16 slot; --h2d-gbps gives yours"


def _plan(args):
    args.h2d_gbps, args.h2d_source = _h2d_gbps(args)
    if args.model:
        described = advice.describe_model(args.model, not args.no_text_encoder, args.lora_rank or 0,
                                          args.mixed_precision,
                                          advice.parse_bytes(args.activations) if args.activations else None,
                                          args.resolution)
    else:
        if args.lora_rank or args.no_text_encoder or args.resolution:
            raise ValueError("--lora-rank, --no-text-encoder and --resolution need --model (a pipeline folder); with "
                             "--params, give --trainable (and --activations)")
        params = advice.parse_count(args.params)
        described = advice.Described(memory_model.Workload(
            params=params, trainable=params, largest_trainable=min(params, memory_model.SD15_LARGEST_TENSOR),
            activations=advice.parse_bytes(args.activations or "0.42GiB")), "--params")
    work = described.work
    if args.trainable:
        trainable = advice.parse_count(args.trainable)
        work = dataclasses.replace(work, trainable=trainable, largest_trainable=min(work.largest_trainable, trainable))
    params, trainable, source = work.params, work.trainable, described.source
    if args.grid:
        return _print_grid(described, work, args)
    machine = advice.Machine.given(
        advice.parse_bytes(args.gpu_memory) if args.gpu_memory else None,
        advice.parse_bytes(args.host_memory) if args.host_memory else None,
    )
    if not machine.gpu or not machine.host:
        missing = " and ".join(n for n, v in (("--gpu-memory", machine.gpu), ("--host-memory", machine.host)) if not v)
        print(f"accel_ds_fix plan: no CUDA device or memory size found here: give {missing}", file=sys.stderr)
        return 2
    nvme_path = args.nvme_path or tiers.DEFAULT_NVME_PATH
    # DeepSpeed, imported for the NVMe tier's checks, logs to stdout: keep stdout for the plan (and its JSON).
    with contextlib.redirect_stdout(sys.stderr):
        rows, recommended = advice.plan(work, machine, args.mixed_precision, args.num_processes, nvme_path,
                                        h2d_gbps=args.h2d_gbps, compute_seconds=args.compute_seconds)
        timing = _nvme_timing(args, work, rows) if args.nvme_path else None
    chosen = args.tier or recommended
    row = next((r for r in rows if r["tier"] == chosen), {})
    written = (_write(chosen, args.write, nvme_path, row.get("nvme_optimizer_ram_gib"), row.get("frozen_on_card_gib"))
               if args.write and chosen else None)
    if args.json:
        print(json.dumps({"params": params, "trainable": trainable, "source": source,
                          "gpu_gib": round(machine.gpu / GIB, 2), "host_gib": round(machine.host / GIB, 2),
                          "gpu_usable_gib": round(machine.gpu_usable / GIB, 2),
                          "host_usable_gib": round(machine.host_usable / GIB, 2),
                          "tiers": rows, "recommended": recommended, "nvme_timing": timing, "written": written,
                          "h2d_gbps": args.h2d_gbps, "h2d_source": args.h2d_source},
                         indent=1))
    else:
        _print_plan(params, trainable, source, machine, args, rows, recommended, work)
        if timing:
            _print_timing(timing, args)
        if written:
            print(f"\nwrote {written[0]}\n      {written[1]}\nrun:  ACCEL_DS_FIX=1 accelerate launch --config_file "
                  f"{written[0]} YOUR_SCRIPT.py ... --mixed_precision {args.mixed_precision}")
    if args.write and not chosen:
        print("accel_ds_fix plan: no tier fits, nothing written (name one with --tier to write it anyway)",
              file=sys.stderr)
        return 1
    return 0


def _print_grid(described, work, args):
    """`plan --grid`: the tier for each card and RAM size of the grid, GPU, host and disk predicted."""
    cells = advice.grid(work, args.mixed_precision, args.num_processes, args.nvme_path or tiers.DEFAULT_NVME_PATH,
                        args.h2d_gbps)
    if args.json:
        print(json.dumps({"params": work.params, "trainable": work.trainable, "source": described.source,
                          "frozen_on_gpu_gib": round(work.frozen_on_gpu / GIB, 2), "cells": cells}, indent=1))
        return 0
    print(f"{described.source}\n{work.params / 1e6:.0f}M parameters prepared, {work.trainable / 1e6:.0f}M trained, "
          f"{args.mixed_precision}, activations {work.activations / GIB:.2f} GiB"
          + (f", {work.frozen_on_gpu / GIB:.1f} GiB frozen on the card beside them ("
             + ", ".join(f"{c} {b / GIB:.1f}" for c, b in described.frozen) + ")" if work.frozen_on_gpu else ""))
    disk = None
    print(f"\n{'card':>5} {'RAM':>5}  {'tier':<20}{'GPU':>9}{'host':>9}{'NVMe':>9}  s/step on the disk")
    for cell in cells:
        row = cell["row"]
        head = f"{cell['card_gb']:>3}GB {cell['ram_gb']:>3}GB  "  # GiB, as the cards' and DIMMs' GB are
        if row is None:
            c = cell["closest"]
            host = max(c["host_gib"], c["host_resume_gib"])
            why = (f"{c['tier']} fits the card but needs {host:.0f} GiB of RAM" if c["fits_gpu"] else
                   f"even {c['tier']} needs {c['gpu_reserved_gib']:.1f} GiB of the card")
            print(head + f"{'none fits':<20}{'':>27}  ({why})")
            continue
        if row["nvme_gib"]:
            disk = disk or _grid_disk(args)
            settings = memory_model.Settings.from_config(
                tiers.BY_NAME[row["tier"]].deepspeed_config(nvme_ram_gib=row["nvme_optimizer_ram_gib"]),
                args.mixed_precision, args.num_processes)
            t = advice.nvme_step_times(work, disk, 0.0, settings=settings, accumulations=(1,))[0]
            seconds = f"{t['disk_seconds']:.0f} + compute"
        elif row["copy_seconds_per_step"]:
            seconds = f"- (copies {row['copy_seconds_per_step']:.1f} s a step)"
        else:
            seconds = "-"
        print(head + f"{row['tier']:<20}{row['gpu_reserved_gib']:>5.1f} GiB{row['host_gib']:>5.1f} GiB"
                     + (f"{row['nvme_gib']:>5.0f} GiB" if row["nvme_gib"] else f"{'-':>9}") + f"  {seconds}")
    if work.moved_before_prepare:
        print(f"\nThe LoRA scripts move the frozen base to the card themselves before prepare() "
              f"({work.moved_before_prepare / GIB:.1f} GiB here, `transformer.to(accelerator.device, dtype=weight_dtype)`): "
              "under zero2-offload it stays there whole; under zero2-stream and ZeRO-3 the fix holds that move back "
              "and keeps on the card what fits, streaming the rest (zero2-stream) or partitioning the base from host "
              f"memory (ZeRO-3), which is how a card smaller than the base trains it. The copies' seconds assume "
              f"{args.h2d_gbps:g} GB/s from pinned memory to the card ({args.h2d_source}).")
    if disk is not None:
        print(f"\nthe disk: {disk.describe()}" + ("" if args.nvme_path else " (assumed: give --nvme-path DIR to "
                                                                                 "measure yours)"))
    print("GiB predicted per process; a card's or RAM's GB as sold are GiB (12 GB: 12288 MiB), less what the CUDA "
          "context, display and system keep. `plan --model ... --gpu-memory G --host-memory H` shows one machine in full; --write DIR writes it.")
    return 0


def _grid_disk(args):
    if args.nvme_path:
        with contextlib.redirect_stdout(sys.stderr):
            return disk_speed.measure(args.nvme_path, tiers.BY_NAME["zero3-nvme"].deepspeed_config().get("aio", {}))
    return disk_speed.ASSUMED_NVME


def _write(tier_name, folder, nvme_path, nvme_ram_gib=None, frozen_on_card_gib=None):
    try:
        return tiers.write(tiers.BY_NAME[tier_name], folder, nvme_path=nvme_path, nvme_ram_gib=nvme_ram_gib,
                           frozen_on_card_gib=frozen_on_card_gib)
    except OSError as exc:
        raise ValueError(f"cannot write the config into {folder}: {exc.strerror}; give a folder you can write "
                         "(it is made where missing)") from exc


def _nvme_timing(args, work, rows):
    """Measure the NVMe folder's disk and predict the NVMe tier's step; None where the tier cannot run here."""
    row = next(r for r in rows if r["tier"] == "zero3-nvme")
    if not row["can_run_here"]:
        return {"measured": False, "why_not": row["cannot_run_here"]}
    config = tiers.BY_NAME["zero3-nvme"].deepspeed_config(args.nvme_path, row["nvme_optimizer_ram_gib"])
    speed = disk_speed.measure(args.nvme_path, section(config, "aio"))
    settings = memory_model.Settings.from_config(config, args.mixed_precision, args.num_processes)
    kept, _ = memory_model.kept_in_ram(work, settings)
    compute = args.compute_seconds if args.compute_seconds is not None else disk_speed.DEFAULT_COMPUTE_SECONDS
    return {"measured": True, "folder": args.nvme_path, "read_gb_per_s": round(speed.read / 1e9, 3),
            "write_gb_per_s": round(speed.write / 1e9, 3), "both_gb_per_s": round(speed.both / 1e9, 3),
            "disk": speed.describe(), "pipelined": settings.pipelined, "compute_seconds": compute,
            "steps": args.steps, "kept_in_ram_gib": round(settings.nvme_ram / GIB, 2),
            "trained_in_ram": kept * settings.world_size,
            "per_accumulation": advice.nvme_step_times(work, speed, compute, args.steps, settings)}


def _print_timing(timing, args):
    if not timing["measured"]:
        print(f"\nNVMe folder not measured: zero3-nvme cannot run here ({timing['why_not']})")
        return
    print(f"\nNVMe folder {timing['folder']}: its disk {timing['disk']} (measured now)")
    way = "reading and writing at once, as the tier's pipelined swaps do" if timing["pipelined"] else "reading, then writing"
    print(f"zero3-nvme, predicted: the disk's time ({way}) plus {timing['compute_seconds']:.1f} s a batch outside it "
          "(--compute-seconds)")
    if timing["trained_in_ram"]:
        print(f"  ({timing['trained_in_ram'] / 1e6:.0f}M of the trained parameters step in RAM, off the disk: the "
              f"config's accel_ds_fix.nvme_optimizer_ram_gib, {timing['kept_in_ram_gib']} GiB)")
    steps = timing["steps"]
    print(f"  {'accumulation':<14}{'s/step':>8}{'disk s':>8}" + (f"{'hours for ' + str(steps) + ' steps':>22}"
                                                                   f"{'written to the SSD':>21}" if steps else ""))
    for r in timing["per_accumulation"]:
        line = f"  {r['gradient_accumulation']:<14}{r['seconds_per_step']:>8.1f}{r['disk_seconds']:>8.1f}"
        if steps:
            line += f"{r['hours']:>22.1f}{r['disk_written_gb'] / 1000:>18.1f} TB"
        print(line)
    print("  (the disk's part comes once per optimizer step: accumulating k batches spreads it over k batches; "
          f"each step writes {timing['per_accumulation'][0]['written_per_step_gb']:.1f} GB)")


def _print_plan(params, trainable, source, machine, args, rows, recommended, work):
    print(f"{params / 1e6:.1f}M parameters ({source}), {trainable / 1e6:.1f}M trainable, {args.mixed_precision}, "
          f"{args.num_processes} process(es), activations {work.activations / GIB:.2f} GiB")
    if work.frozen_on_gpu:
        print(f"on the card beside them, frozen and never prepared: {work.frozen_on_gpu / GIB:.2f} GiB (the scripts keep "
              "these there)")
    print(f"GPU  {machine.gpu / GIB:.1f} GiB: {machine.gpu_usable / GIB:.1f} usable "
          f"({advice.GPU_RESERVE / GIB:.1f} kept for the CUDA context and display)")
    print(f"host {machine.host / GIB:.1f} GiB: {machine.host_usable / GIB:.1f} usable "
          f"({advice.HOST_RESERVE / GIB:.1f} kept for the system and desktop)\n")
    print(f"{'tier':<20}{'GPU reserved':>13}{'host peak':>11}{'resuming':>10}{'NVMe':>9}  fits")
    for r in rows:
        host = "host" if not r["fits_host_training"] else "host when resuming (load_state reads the sub groups kept in RAM)"
        verdict = "yes" if r["fits"] else "no: " + " and ".join(
            n for n, ok in (("GPU", r["fits_gpu"]), (host, r["fits_host"])) if not ok)
        if not r["can_run_here"]:
            verdict += ", and cannot run here (below)"
        nvme = f"{r['nvme_gib']:.1f} GiB" if r["nvme_gib"] else "-"
        print(f"{r['tier']:<20}{r['gpu_reserved_gib']:>9.1f} GiB{r['host_gib']:>7.1f} GiB{r['host_resume_gib']:>6.1f} GiB"
              f"{nvme:>9}  {verdict}")
    for r in rows:
        if r["caveat"]:
            print(f"  {r['tier']}: {r['caveat']}")
        if not r["can_run_here"]:
            print(f"  {r['tier']}: cannot run here: {r['cannot_run_here']}")
        for note in r["notes"]:
            print(f"  {r['tier']}: {note}")
        if r["nvme_optimizer_ram_gib"] is not None:
            shipped = tiers.BY_NAME[r["tier"]].deepspeed_config()["accel_ds_fix"]["nvme_optimizer_ram_gib"]
            lowered = f" (of the shipped {shipped:g}, to fit this host)" if r["nvme_optimizer_ram_gib"] < shipped else ""
            print(f"  {r['tier']}: keeps {r['nvme_optimizer_ram_gib']:g} GiB of optimizer sub groups in RAM{lowered}: "
                  f"{r['trained_in_ram'] / 1e6:.0f}M parameters step off the disk (accel_ds_fix.nvme_optimizer_ram_gib)")
    if recommended:
        tier = tiers.BY_NAME[recommended]
        print(f"\nrecommended: {recommended}: {tier.title}.")
        if not args.write:
            print("write it:    python -m accel_ds_fix plan ... --write DIR")
    else:
        print("\nno tier fits and runs here: train fewer parameters (LoRA, see the README), use a machine with more "
              "memory, or provide what a tier above lacks.")


def _get_libaio(folder):
    if libaio.on_system():
        print("libaio: the system has it (libaio.h and libaio.so); nothing to fetch")
        return 0
    try:
        folder = libaio.fetch(folder)
    except libaio.LibaioError as exc:
        print(f"libaio: {exc}", file=sys.stderr)
        return 1
    if os.path.abspath(folder) != os.path.abspath(libaio.default_folder()):
        print(f"libaio: runs that should use it need {libaio.ENV}={folder} in their environment")
    return 0


def _convert_checkpoint(folder, tag):
    from ..checkpoints.layout import change as layout_change
    from ..errors import CheckpointError

    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout
            converted, seconds, reused = layout_change.convert_ahead(folder, tag)
    except CheckpointError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    if reused:
        print(f"{converted} is already the universal copy of {folder}: nothing to do")
    else:
        print(f"converted {folder} to DeepSpeed's universal checkpoint format in {seconds:.1f} s: {converted} "
              "(load_state reuses it under any ZeRO stage, number of processes and offload)")
    return 0


def _clean_swap(folder):
    from ..nvme import swap_folder

    if not os.path.isdir(folder):
        print(f"accel_ds_fix clean-swap: {folder} is not a folder", file=sys.stderr)
        return 2
    freed, live = swap_folder.clean(folder)
    print(f"removed {freed / GIB:.2f} GiB of NVMe swap files that dead runs left in {folder}")
    if live:
        print(f"left alone: process folder(s) {', '.join(map(str, live))}, in use by a live run")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m accel_ds_fix",
                                     description="Without a command: report whether the fix is active here.")
    sub = parser.add_subparsers(dest="command")
    _plan_parser(sub)
    sub.add_parser("build-ops", help="compile DeepSpeed's ops the shipped configs use, once, before the first run",
                   description="Compile cpu_adam (optimizer offload), async_io (NVMe offload, needs libaio) and, on "
                               "the CPU backend, DeepSpeed's shared-memory collectives, into torch's extension cache "
                               "(TORCH_EXTENSIONS_DIR), so the first training run does not stall in prepare().")
    fetch = sub.add_parser("get-libaio", help="without root: unpack Debian's libaio for the NVMe tier's async_io op",
                           description="Download Debian's libaio-dev and libaio packages (apt-get download, no root) "
                                       "and unpack them into DIR, where the fix finds them when DeepSpeed builds "
                                       "or loads its async_io op. Nothing to do where the system has libaio.")
    fetch.add_argument("folder", nargs="?", metavar="DIR",
                       help=f"where to unpack (default: ${libaio.ENV}, else {libaio.default_folder()})")
    convert = sub.add_parser("convert-checkpoint", help="convert a save_state folder for another DeepSpeed layout, "
                                                        "before the run that resumes it",
                             description="Write the universal copy (.accel_ds_fix-universal.DIR beside DIR) that "
                                         "load_state would write when resuming DIR under another ZeRO stage, "
                                         "number of processes or optimizer offload; that run then reuses it. For "
                                         "runs short of host memory: the conversion holds one rank's optimizer "
                                         "states file in memory.")
    convert.add_argument("folder", metavar="DIR", help="a folder accelerator.save_state() wrote")
    convert.add_argument("--tag", default="pytorch_model", help="the engine's checkpoint inside it (default "
                                                               "pytorch_model)")
    clean = sub.add_parser("clean-swap", help="remove the NVMe swap files that killed runs left in a folder",
                           description="DeepSpeed leaves its swap files (gigabytes) in nvme_path when a run is "
                                       "killed. Removes those of every process folder no live run holds; a live "
                                       "run's are left alone. A run removes the dead files of its own process "
                                       "folders by itself, and its own at a clean exit.")
    clean.add_argument("folder", metavar="DIR", help="the nvme_path of the DeepSpeed config")
    args = parser.parse_args(argv)
    if args.command == "clean-swap":
        return _clean_swap(args.folder)
    if args.command == "convert-checkpoint":
        return _convert_checkpoint(args.folder, args.tag)
    if args.command == "get-libaio":
        return _get_libaio(args.folder)
    if args.command == "build-ops":
        return 0 if builds.build(report=lambda line: print(line, flush=True)) else 1
    if args.command == "plan":
        try:
            return _plan(args)
        except ValueError as exc:
            parser.error(str(exc))
    print("\n".join(report.lines()))
    return 0
