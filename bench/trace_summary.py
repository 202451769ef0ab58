# Summarises a Chrome-trace JSON written by `loom bench train --profile PATH` or
# `loom bench sample --profile PATH` (Kineto): the traced span, how much of it the GPU was
# busy (the union of kernel, memcpy and memset intervals), the kernel and CPU op counts, and
# the kernels and CPU ops that took the most time.
#
# --within NAME keeps only the work of the named spans (user annotations whose name contains
# NAME, e.g. the sampler's "sampler prefill" and "sampler decode" steps): the CPU ops and
# CUDA API calls on a span's thread inside it, and the GPU work those calls launched
# (matched by correlation id). The span is then the named spans' total time.
#
# --during NAME keeps everything that ran while the named spans were open, on any thread and
# any stream, cut to their windows: a training pass's backward runs on autograd's threads,
# which --within does not see. It also lists the longest gaps in the GPU's work inside the
# windows, each with the CPU ops open at its middle on the spans' threads (what the GPU waited for).
#
#   python3 bench/trace_summary.py TRACE.json [--top N] [--within NAME | --during NAME]
import argparse, bisect, collections, json

THREAD_CATS = ("cpu_op", "cuda_runtime", "cuda_driver")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def union_us(intervals):
    total, end = 0.0, None
    for b, e in sorted(intervals):
        if end is None or b > end:
            total += e - b
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def within(events, name):
    """The events of the spans named `name` and the span time they cover (us)."""
    spans = [e for e in events if e.get("cat") == "user_annotation" and name in e["name"]]
    by_thread = collections.defaultdict(list)  # a thread's spans are sequential: sorted, found by bisection
    for s in spans:
        by_thread[(s.get("pid"), s.get("tid"))].append((s["ts"], s["ts"] + s["dur"]))
    for v in by_thread.values():
        v.sort()

    def inside(e):
        v = by_thread.get((e.get("pid"), e.get("tid")), [])
        i = bisect.bisect_right(v, (e["ts"], float("inf"))) - 1
        return i >= 0 and e["ts"] + e["dur"] <= v[i][1]

    kept, launched = [], set()
    for e in events:
        if e.get("cat") not in THREAD_CATS:
            continue
        if inside(e):
            kept.append(e)
            if e.get("cat") != "cpu_op" and "correlation" in e.get("args", {}):
                launched.add(e["args"]["correlation"])
    kept += [e for e in events if e.get("cat") in GPU_CATS and e.get("args", {}).get("correlation") in launched]
    return kept, len(spans), union_us([(s["ts"], s["ts"] + s["dur"]) for s in spans])


def merged(intervals):
    out = []
    for b, e in sorted(intervals):
        if out and b <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([b, e])
    return out


def during(events, name):
    """Every event cut to the windows of the spans named `name`, the span time, and the GPU gaps."""
    spans = [e for e in events if e.get("cat") == "user_annotation" and name in e["name"]]
    windows = merged([(s["ts"], s["ts"] + s["dur"]) for s in spans])
    starts = [w[0] for w in windows]

    def cut(e):
        b, end = e["ts"], e["ts"] + e["dur"]
        i = max(bisect.bisect_right(starts, b) - 1, 0)
        dur = 0.0
        while i < len(windows) and windows[i][0] < end:
            dur += max(0.0, min(end, windows[i][1]) - max(b, windows[i][0]))
            i += 1
        return dur

    kept = []
    for e in events:
        if e.get("cat") == "user_annotation":
            continue
        d = cut(e)
        if d > 0:
            kept.append(dict(e, dur=d))
    # The GPU's idle time inside the windows, longest first.
    busy = merged([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS])
    gaps = []
    for wb, we in windows:
        t = wb
        for b, e in busy:
            if e <= wb or b >= we:
                continue
            if b > t:
                gaps.append((b - t, t))
            t = max(t, e)
        if we > t:
            gaps.append((we - t, t))
    gaps.sort(reverse=True)
    threads = {(s.get("pid"), s.get("tid")) for s in spans}
    open_ops = [e for e in events if e.get("cat") == "cpu_op" and (e.get("pid"), e.get("tid")) in threads]
    t0 = windows[0][0] if windows else 0
    notes = []
    for length, at in gaps[:10]:
        mid = at + length / 2
        names = [e["name"][:50] for e in sorted(open_ops, key=lambda e: e["ts"])
                 if e["ts"] <= mid <= e["ts"] + e["dur"]]
        notes.append((length, at - t0, " > ".join(names[-3:]) or "(no op open)"))
    return kept, len(spans), sum(e - b for b, e in windows), notes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--within", help="only the work inside user annotations whose name contains this")
    ap.add_argument("--during", help="everything, any thread, while user annotations whose name contains this ran")
    a = ap.parse_args()
    events = [e for e in json.load(open(a.trace))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    if not events:
        print("no events")
        return
    t0 = min(e["ts"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - t0
    gaps = None
    if a.within:
        events, n, span = within(events, a.within)
        print(f"within {n} spans named '{a.within}'")
    elif a.during:
        events, n, span, gaps = during(events, a.during)
        print(f"during {n} spans named '{a.during}'")
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    print(f"span {span / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({100 * busy / max(span, 1):.0f}%), "
          f"{len(kernels)} kernels, {len(ops)} cpu ops")
    for title, group in (("kernels", gpu), ("cpu ops (inclusive)", ops)):
        by = collections.defaultdict(lambda: [0.0, 0])
        for e in group:
            by[e["name"][:90]][0] += e["dur"]
            by[e["name"][:90]][1] += 1
        print(f"top {title} by total time:")
        for name, (dur, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[: a.top]:
            print(f"  {dur / 1e3:9.2f} ms {n:6d}x  {name}")
    if gaps:
        print(f"longest GPU gaps inside the spans ({sum(g[0] for g in gaps) / 1e3:.1f} ms in the top {len(gaps)}): "
              "length, ms after the first span began, the spans' threads' ops open at its middle")
        for length, at, names in gaps:
            print(f"  {length / 1e3:9.2f} ms at {at / 1e3:9.1f}  {names}")


if __name__ == "__main__":
    main()
