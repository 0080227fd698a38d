"""Measure an unmodified accelerate training script (diffusers' examples, kohya's...) from the outside.

As a runner, in place of the script (accelerate launch starts it in the training process; the script runs as
__main__ with its own argv, unchanged):

    PROBE_OUT=run.json [PROBE_CAP_GIB=16] accelerate launch --config_file C.yaml script_probe.py SCRIPT.py ARGS...

or imported at start-up by a .pth in site-packages (then it acts only where PROBE_OUT is set, in whichever process
makes an Accelerator):

    cp script_probe.py $SITE/ && echo "import script_probe" > $SITE/zz_script_probe.pth

Settings (environment):
- PROBE_OUT: the JSON report, rewritten at every accelerator.backward, at SIGTERM (`timeout`) and at exit.
- PROBE_CAP_GIB: cap the card at this much (torch.cuda.set_per_process_memory_fraction) when the Accelerator is made,
  as a card of that size would be (the CUDA context and libraries' workspaces are outside the cap).
- PROBE_SAMPLE_S: seconds between memory samples (default 1).
- PROBE_SDPA=no-cudnn: turn off cuDNN's scaled-dot-product attention when the Accelerator is made. On torch
  2.11+cu130 with cuDNN 9.19 its backward gives Flux wrong gradients (H100) or an illegal memory access (H200), with
  or without DeepSpeed (docs/gpu.md, run 13; bench/diffusers/flux_backward_probe.py checks a stack).
- PROBE_PROFILE_STEP=K: torch.profiler (CPU and CUDA) from the K-th accelerator.backward call to the next one (one
  whole step: the backward, the optimizer, the next batch's encoders and forward); the chrome trace goes to
  PROBE_OUT + ".trace.json.gz" (bench/stream_profile.py reads it: the card's computing, the copies, their overlap).
- PROBE_STREAM_PREFETCH=N: the streaming tier's streamer prefetches N blocks ahead instead of 1 (a bench knob).
- PROBE_STREAM_ORDER=prepared: the streaming tier keeps the prepared models' blocks on the card before those of the
  models beside them (T5, the VAE), the order before keep_first (a bench knob, to compare).

The report: every loss passed to accelerator.backward and the time of each call (step_times: the seconds between
calls, i.e. one optimizer step each without gradient accumulation; under DeepSpeed, accelerate's backward also
steps the optimizer); marks (Accelerator made, prepare() entered/left, each backward, wait_for_everyone,
end_training, exit), each with the process's memory then; samples every PROBE_SAMPLE_S; and the peaks of each
phase: "load" (start-up to the first prepare()), "prepare" (inside prepare()), "training" (from prepare()'s return
to the first mark after the last backward of the phase: the training loop), "after" (the script's saving and final
inference, to exit). At each phase's end the high-water marks are read and reset: the host's VmHWM (= ru_maxrss:
the resident peak, file-backed pages of mapped checkpoints included; reset through /proc/self/clear_refs, the
report's hwm_reset says whether that worked) beside the largest RssAnon sampled every 50 ms (what the process
itself allocated), and the GPU's torch.cuda.max_memory_allocated / max_memory_reserved (the caching allocator's;
nvidia-smi adds the context). "whole" is the largest of each over the phases.
"""
import atexit
import json
import os
import resource
import signal
import sys
import threading
import time

OUT = os.environ.get("PROBE_OUT")
T0 = time.time()
GIB = 2**30
_state = {"losses": [], "backward_at": [], "marks": [], "samples": [], "phases": [], "cap_gib": None,
          "accelerator": False, "hwm_reset": None}
_phase = {"name": "load", "start": 0.0, "anon_max": 0.0, "backwards": 0}
_lock = threading.Lock()


def _proc_status():
    """The process's memory from /proc/self/status, GiB."""
    fields = {"VmRSS": "rss", "VmHWM": "hwm", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in fields:
                    out[fields[key]] = round(int(line.split()[1]) / 2**20, 3)
    except OSError:
        out["hwm"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    return out


def _available_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return round(int(line.split()[1]) / 2**20, 3)
    except OSError:
        return None


def _torch_cuda():
    """torch.cuda where CUDA is already up (the probe never initialises it), else None."""
    torch = sys.modules.get("torch")
    try:
        return torch.cuda if torch is not None and torch.cuda.is_initialized() else None
    except Exception:
        return None


def _cuda():
    """The caching allocator's figures, GiB."""
    cuda = _torch_cuda()
    try:
        return {} if cuda is None else {
            "alloc": round(cuda.memory_allocated() / GIB, 3), "reserved": round(cuda.memory_reserved() / GIB, 3),
            "max_alloc": round(cuda.max_memory_allocated() / GIB, 3),
            "max_reserved": round(cuda.max_memory_reserved() / GIB, 3)}
    except Exception:  # best effort: a probe never changes the script's course
        return {}


def _snapshot(label=None):
    snap = {"t": round(time.time() - T0, 3), **_proc_status(), **_cuda()}
    if label:
        snap["label"] = label
    if label == "backward":  # what the step so far cost beyond the computing: allocator retries, stream waits
        snap.update(_allocator_counts())
        streaming = _streaming()
        if streaming:
            snap["stream_loads"] = sum(s["loads"] for s in streaming)
            snap["stream_waited"] = sum(s["waited"] for s in streaming)
    return snap


def _allocator_counts():
    """The caching allocator's counters that mean a synchronisation: retries (a cudaMalloc that failed, the cache
    freed, the card synchronised) and cudaMalloc/cudaFree calls."""
    cuda = _torch_cuda()
    try:
        stats = {} if cuda is None else cuda.memory_stats()
    except Exception:
        return {}
    return {key: stats.get(name, 0) for key, name in (("alloc_retries", "num_alloc_retries"),
                                                      ("device_allocs", "num_device_alloc"),
                                                      ("device_frees", "num_device_free"))}


def _phase_peaks(snap):
    return {"name": _phase["name"], "start": _phase["start"], "end": snap["t"], "hwm": snap.get("hwm"),
            "anon_max": max(_phase["anon_max"], snap.get("anon", 0)), "max_alloc": snap.get("max_alloc"),
            "max_reserved": snap.get("max_reserved")}


def _next_phase(snap, name):
    """Close the running phase at snap (its peaks), reset the high-water marks, open the phase name."""
    with _lock:
        _state["phases"].append(_phase_peaks(snap))
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM back to the current RSS
            _state["hwm_reset"] = _state["hwm_reset"] is not False
        except OSError:
            _state["hwm_reset"] = False
        cuda = _torch_cuda()
        if cuda is not None:
            cuda.reset_peak_memory_stats()
        _phase.update(name=name, start=snap["t"], anon_max=snap.get("anon", 0), backwards=0)


def mark(label):
    snap = _snapshot(label)
    _state["marks"].append(snap)
    with _lock:
        _phase["anon_max"] = max(_phase["anon_max"], snap.get("anon", 0))
    if label == "prepare":
        _next_phase(snap, "prepare")
    elif label == "prepared":
        _next_phase(snap, "training")
    elif label == "backward":
        _phase["backwards"] += 1
        if _phase["name"] != "training":  # a backward outside prepare()'s training phase (a second loop)
            _next_phase(snap, "training")
            _phase["backwards"] = 1
    elif _phase["name"] == "training" and _phase["backwards"]:  # the first other mark after a backward
        _next_phase(snap, "after")


def _sampler(interval):
    last = 0.0
    while True:
        time.sleep(0.05)
        anon = _proc_status().get("anon", 0)
        with _lock:
            _phase["anon_max"] = max(_phase["anon_max"], anon)
        if time.time() - last >= interval:
            last = time.time()
            snap = _snapshot()
            snap["available"] = _available_gib()
            _state["samples"].append(snap)


def _median(xs):
    xs = sorted(xs)
    return (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2 if xs else None


def report():
    times = _state["backward_at"]
    steps = [round(b - a, 4) for a, b in zip(times, times[1:])]
    phases = _state["phases"] + [dict(_phase_peaks(_snapshot()), running=True)]
    peaks = {}
    for phase in phases:
        best = peaks.setdefault(phase["name"], {})
        for key in ("hwm", "anon_max", "max_alloc", "max_reserved"):
            if phase.get(key) is not None:
                best[key] = max(best.get(key, 0), phase[key])
    peaks["whole"] = {key: max((p[key] for p in peaks.values() if p.get(key) is not None), default=None)
                      for key in ("hwm", "anon_max", "max_alloc", "max_reserved")}
    return {"argv": sys.argv, "pid": os.getpid(), "cap_gib": _state["cap_gib"], "hwm_reset": _state["hwm_reset"],
            "losses": _state["losses"], "step_times": steps,
            "median_step_s_after_first": _median(steps[1:]) if len(steps) > 1 else _median(steps),
            "first_backward_s": round(times[0] - T0, 3) if times else None, "peaks": peaks, "phases": phases,
            "marks": _state["marks"], "samples": _state["samples"], "streaming": _streaming(),
            "profile": _state.get("profile"), "stream_prefetch": _state.get("stream_prefetch"),
            "stream_order": _state.get("stream_order")}


def _streaming():
    """The streaming tier's counters (accel_ds_fix.streaming), where it ran: blocks streamed, copies, waits."""
    build = sys.modules.get("accel_ds_fix.streaming.engine_build")
    if build is None:
        return None
    return [{"blocks": len(s.blocks), "loads": s.loads, "waited": s.waited, "copied_gib": s.bytes_copied / GIB,
             "host_gib": s.host_bytes / GIB, "order": len(s.order)} for s in build.streamers]


def write(*_):
    if not (OUT and _state["accelerator"]):  # only the process that trains (a launcher makes no Accelerator)
        return
    try:
        tmp = f"{OUT}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(report(), f, indent=1)
        os.replace(tmp, OUT)
    except Exception as e:
        sys.stderr.write(f"script_probe: report not written: {e!r}\n")


def _patch(accelerate):
    cls = accelerate.Accelerator
    init, prepare, backward = cls.__init__, cls.prepare, cls.backward
    wait, end = cls.wait_for_everyone, cls.end_training

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _state["accelerator"] = True
        cap = os.environ.get("PROBE_CAP_GIB")
        if cap:
            import torch

            if torch.cuda.is_available() and self.device.type == "cuda":
                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                total = torch.cuda.get_device_properties(index).total_memory
                torch.cuda.set_per_process_memory_fraction(float(cap) * 2**30 / total, index)
                _state["cap_gib"] = float(cap)
        if os.environ.get("PROBE_SDPA") == "no-cudnn":
            import torch

            torch.backends.cuda.enable_cudnn_sdp(False)
            _state["sdpa"] = "no-cudnn"
        mark("accelerator")

    def prepare_(self, *args, **kwargs):
        outermost = _state.setdefault("prepare_depth", 0) == 0  # a prepare() inside prepare() is its phase's
        if outermost:
            mark("prepare")
        _state["prepare_depth"] += 1
        try:
            return prepare(self, *args, **kwargs)
        finally:
            _state["prepare_depth"] -= 1
            if outermost:
                mark("prepared")

    def backward_(self, loss, *args, **kwargs):
        _state["losses"].append(float(loss.detach().float().item()))
        _state["backward_at"].append(time.time())
        _profile(len(_state["losses"]))
        mark("backward")
        write()
        return backward(self, loss, *args, **kwargs)

    def wait_for_everyone_(self, *args, **kwargs):
        mark("wait_for_everyone")
        return wait(self, *args, **kwargs)

    def end_training_(self, *args, **kwargs):
        mark("end_training")
        return end(self, *args, **kwargs)

    cls.__init__, cls.prepare, cls.backward = __init__, prepare_, backward_
    cls.wait_for_everyone, cls.end_training = wait_for_everyone_, end_training_


_profiler = []


def _profile(calls):
    """PROBE_PROFILE_STEP=K: start torch.profiler at the K-th backward call, stop and export at the next."""
    step = int(os.environ.get("PROBE_PROFILE_STEP") or 0)
    if not step:
        return
    import torch

    if calls == step:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        prof = torch.profiler.profile(activities=activities)
        prof.start()
        _profiler.append((prof, time.time()))
    elif calls == step + 1 and _profiler:
        prof, start = _profiler.pop()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.stop()
        _state["profile"] = {"step": step, "wall_s": round(time.time() - start, 4)}
        try:
            prof.export_chrome_trace(f"{OUT}.trace.json")
            import gzip
            import shutil

            with open(f"{OUT}.trace.json", "rb") as src, gzip.open(f"{OUT}.trace.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(f"{OUT}.trace.json")
        except Exception as e:
            _state["profile"]["error"] = repr(e)


def _stream_prefetch(streamer_module):
    depth = int(os.environ["PROBE_STREAM_PREFETCH"])
    init = streamer_module.Streamer.__init__

    def __init__(self, device, prefetch=1):
        init(self, device, prefetch=depth)

    streamer_module.Streamer.__init__ = __init__
    _state["stream_prefetch"] = depth


def _prepared_first(engine_build):
    engine_build.keep_first = lambda by_model: [b for blocks, prepared in sorted(by_model, key=lambda m: not m[1])
                                                for b in blocks]
    _state["stream_order"] = "prepared first"


def _on_sigterm(signum, frame):
    mark("SIGTERM")
    write()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install():
    if "accelerate" in sys.modules:
        _patch(sys.modules["accelerate"])
    else:
        import wrapt

        wrapt.register_post_import_hook(_patch, "accelerate")
    if os.environ.get("PROBE_STREAM_PREFETCH"):
        import wrapt

        wrapt.register_post_import_hook(_stream_prefetch, "accel_ds_fix.streaming.streamer")
    if os.environ.get("PROBE_STREAM_ORDER") == "prepared":
        import wrapt

        wrapt.register_post_import_hook(_prepared_first, "accel_ds_fix.streaming.engine_build")
    threading.Thread(target=_sampler, args=(float(os.environ.get("PROBE_SAMPLE_S", "1")),), daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    atexit.register(lambda: (mark("exit"), write()))


def run_script(argv):
    """Run SCRIPT ARGS as __main__, as `python SCRIPT ARGS` would (its folder first on sys.path)."""
    import runpy

    script = os.path.abspath(argv[0])
    sys.argv = [script] + argv[1:]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if OUT:
        install()
    run_script(sys.argv[1:])
elif OUT:
    install()
