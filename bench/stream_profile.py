"""Where a profiled step's time went on the card: the computing (kernels), the host-to-card copies, their overlap,
and the time the card did neither (waiting for the host), from a chrome trace of torch.profiler
(bench/diffusers/script_probe.py with PROBE_PROFILE_STEP=K writes one).

    python bench/stream_profile.py RUN.json.trace.json.gz [--json OUT.json]

Prints, in seconds of the profiled window: kernels busy (their union over every stream), host-to-card copies busy
and their bytes (so the rate they ran at), the overlap of the two, the copies nothing hid (copy only), the card
idle (neither), and the longest idle gaps with the host's longest operations running then (what the card waited
for)."""

import argparse
import gzip
import json


def union(intervals):
    """Sorted, merged [start, end) intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def length(intervals):
    return sum(end - start for start, end in intervals)


def intersect(a, b):
    """The overlap of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append([start, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def gaps(busy, start, end):
    """The intervals of [start, end) that busy leaves free."""
    out, at = [], start
    for s, e in busy:
        if s > at:
            out.append([at, s])
        at = max(at, e)
    if end > at:
        out.append([at, end])
    return out


def analyse(events, top=8):
    kernels, copies, other_gpu, cpu = [], [], [], []
    copy_bytes = 0
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        span = (float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]))
        cat, name = ev.get("cat", ""), ev.get("name", "")
        if cat == "kernel":
            kernels.append(span)
        elif cat == "gpu_memcpy" and "HtoD" in name:
            copies.append(span)
            copy_bytes += int((ev.get("args") or {}).get("bytes", 0) or 0)
        elif cat in ("gpu_memcpy", "gpu_memset"):
            other_gpu.append(span)
        elif cat in ("cpu_op", "python_function", "user_annotation"):
            cpu.append((span, name))
    gpu = kernels + copies + other_gpu
    if not gpu:
        return {"error": "no card events in the trace (a CPU run, or the profiler saw no CUDA activity)"}
    start, end = min(s for s, _ in gpu), max(e for _, e in gpu)
    k, c = union(kernels), union(copies)
    both = intersect(k, c)
    busy = union(gpu)
    idle = gaps(busy, start, end)
    us = 1e-6
    result = {
        "window_s": (end - start) * us, "kernels_s": length(k) * us, "htod_copies_s": length(c) * us,
        "htod_gib": copy_bytes / 2**30, "htod_gbps_while_copying": copy_bytes / 1e9 / (length(c) * us) if c else None,
        "overlap_s": length(both) * us, "copy_only_s": (length(c) - length(both)) * us,
        "idle_s": length(idle) * us, "kernel_count": len(kernels), "htod_count": len(copies),
        "longest_idle": []}
    for s, e in sorted(idle, key=lambda g: g[0] - g[1])[:top]:
        during = sorted(((min(ce, e) - max(cs, s), name) for (cs, ce), name in cpu if cs < e and ce > s),
                        reverse=True)[:4]
        result["longest_idle"].append({"at_s": (s - start) * us, "ms": (e - s) / 1000,
                                       "host_ops": [f"{name} ({ms / 1000:.1f} ms)" for ms, name in during]})
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--json")
    args = p.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        trace = json.load(f)
    result = analyse(trace.get("traceEvents", trace if isinstance(trace, list) else []))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if "error" in result:
        print(result["error"])
        return
    r = result
    print(f"window {r['window_s']:.3f} s: kernels {r['kernels_s']:.3f}, host-to-card copies {r['htod_copies_s']:.3f} "
          f"({r['htod_gib']:.2f} GiB, {r['htod_gbps_while_copying'] or 0:.1f} GB/s while copying), overlap "
          f"{r['overlap_s']:.3f}, copies alone {r['copy_only_s']:.3f}, card idle {r['idle_s']:.3f}")
    for gap in r["longest_idle"]:
        print(f"  idle {gap['ms']:.1f} ms at {gap['at_s']:.3f} s; host: {'; '.join(gap['host_ops'])}")


if __name__ == "__main__":
    main()
