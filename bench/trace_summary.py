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
#   python3 bench/trace_summary.py TRACE.json [--top N] [--within NAME]
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--within", help="only the work inside user annotations whose name contains this")
    a = ap.parse_args()
    events = [e for e in json.load(open(a.trace))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    if not events:
        print("no events")
        return
    t0 = min(e["ts"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - t0
    if a.within:
        events, n, span = within(events, a.within)
        print(f"within {n} spans named '{a.within}'")
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


if __name__ == "__main__":
    main()
