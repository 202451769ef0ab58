# Summarises a Chrome-trace JSON written by `loom bench train --profile PATH` (Kineto): the
# traced span, how much of it the GPU was busy (the union of kernel, memcpy and memset
# intervals), the kernel count, and the kernels and CPU ops that took the most time.
#
#   python3 bench/trace_summary.py TRACE.json [--top N]
import argparse, collections, json


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    events = [e for e in json.load(open(a.trace))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    if not events:
        print("no events")
        return
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    print(f"span {(t1 - t0) / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({100 * busy / max(t1 - t0, 1):.0f}%), "
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
