"""Where a profiled stretch leaves the GPU idle, and which host work it waited on.

Reads a Chrome trace of torch.profiler (CPU and CUDA activities; ``prof.export_chrome_trace``,
optionally gzipped) and prints: the span from the first kernel's start to the last one's end, the
time any kernel, copy or fill ran (their union), the idle rest, and the idle gaps by what ended
them. A gap ends when the next kernel starts; its launch (the CUDA runtime or driver call with the
same correlation id) was either issued after the GPU went idle, so the GPU waited on the host
(*host late*: charged to the host operator that was running the launch, its outermost enclosing
operator on that thread), or before, so the kernel sat queued behind the launch machinery or a
dependency (*queued*).

    python3 tools/trace_gaps.py trace.json.gz [--min-us 2] [--top 15]

``benchmarks/train.py --profile`` runs this on one training step.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

#: trace categories of device work (the union of their intervals is the busy time)
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: trace categories of the host calls that launch device work
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def load(path: str) -> dict:
    """The trace's JSON object (a ``.gz`` file is decompressed)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _events(trace) -> list:
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def analyse(trace, min_us: float = 2.0) -> dict:
    """{"span", "busy", "idle", "host_late", "queued" (µs), "by_op": [(operator, µs, gaps)] largest
    first, "gaps": number of gaps of at least ``min_us``, "longest": the 50 longest gaps as (µs, the
    device work before, the one after, the host operator charged or "queued")} of a trace (a dict
    with ``traceEvents`` or the list of events itself)."""
    evs = [e for e in _events(trace) if e.get("ph") == "X" and "ts" in e]
    dev = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e) for e in evs
                 if e.get("cat") in DEVICE_CATS)
    if not dev:
        return dict(span=0.0, busy=0.0, idle=0.0, host_late=0.0, queued=0.0, by_op=[], gaps=0, longest=[])
    launches = {}
    for e in evs:
        if e.get("cat") in LAUNCH_CATS:
            c = (e.get("args") or {}).get("correlation")
            if c is not None:
                launches[c] = e
    # the outermost host operators of each thread (those no other operator there encloses), by start
    ops = defaultdict(list)
    for e in evs:
        if e.get("cat") == "cpu_op":
            t0 = float(e["ts"])
            ops[(e.get("pid"), e.get("tid"))].append((t0, -(t0 + float(e.get("dur", 0.0))), e.get("name", "?")))
    tops = {}
    for key, v in ops.items():
        v.sort()
        top, end = [], float("-inf")
        for t0, neg_end, name in v:
            if t0 >= end:
                top.append((t0, -neg_end, name))
                end = -neg_end
        tops[key] = top
    starts = {k: [s for s, _, _ in v] for k, v in tops.items()}

    def outermost(pid, tid, t):
        """The outermost operator running on the thread at time t."""
        v = tops.get((pid, tid))
        i = bisect.bisect_right(starts.get((pid, tid), []), t) - 1
        if not v or i < 0 or v[i][1] < t:
            return "(between operators)"
        return v[i][2]

    span0, span1 = dev[0][0], max(end for _, end, _ in dev)
    busy = 0.0
    host_late = queued = 0.0
    by_op = defaultdict(lambda: [0.0, 0])
    longest = []  # (gap µs, work before, work after, the host operator or "queued")
    n_gaps = 0
    cur0, cur1 = dev[0][0], dev[0][1]
    last = dev[0][2]  # the device work that ends last so far
    for s, end, e in dev[1:]:
        if s > cur1:
            busy += cur1 - cur0
            gap = s - cur1
            if gap >= min_us:
                n_gaps += 1
                lc = launches.get((e.get("args") or {}).get("correlation"))
                if lc is not None and float(lc["ts"]) > cur1:
                    host_late += gap
                    op = outermost(lc.get("pid"), lc.get("tid"), float(lc["ts"]))
                    by_op[op][0] += gap
                    by_op[op][1] += 1
                else:
                    queued += gap
                    op = "queued"
                longest.append((gap, last.get("name", "?"), e.get("name", "?"), op))
            cur0, cur1 = s, end
            last = e
        elif end > cur1:
            cur1, last = end, e
    busy += cur1 - cur0
    span = span1 - span0
    rows = sorted(((op, us, n) for op, (us, n) in by_op.items()), key=lambda r: -r[1])
    longest.sort(key=lambda r: -r[0])
    return dict(span=span, busy=busy, idle=span - busy, host_late=host_late, queued=queued, by_op=rows, gaps=n_gaps,
                longest=longest[:50])


def report(res: dict, label: str = "", top: int = 15) -> str:
    """The lines :func:`analyse`'s result prints as."""
    pre = f"{label}: " if label else ""
    out = [f"{pre}GPU span {res['span'] / 1e3:.1f} ms: busy {res['busy'] / 1e3:.1f}, idle {res['idle'] / 1e3:.1f} "
           f"({res['gaps']} gaps: host late {res['host_late'] / 1e3:.1f} ms, queued {res['queued'] / 1e3:.1f} ms)"]
    if res["by_op"]:
        out.append(f"{pre}host-late gaps by the host operator that launched the next kernel, ms (gaps):")
        out += [f"  {us / 1e3:8.2f}  ({n:4d})  {op[:110]}" for op, us, n in res["by_op"][:top]]
    if res["longest"]:
        out.append(f"{pre}longest gaps, µs: before → after (charged to)")
        out += [f"  {us:8.1f}  {a[:45]} → {b[:45]} ({op[:60]})" for us, a, b, op in res["longest"][:top]]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a Chrome trace of torch.profiler (.json or .json.gz)")
    ap.add_argument("--min-us", type=float, default=2.0, help="shortest gap counted (µs)")
    ap.add_argument("--top", type=int, default=15, help="operators listed")
    a = ap.parse_args(argv)
    try:
        trace = load(a.trace)
    except (OSError, ValueError) as e:
        ap.exit(2, f"trace_gaps.py: error: trace: cannot read {a.trace!r}: {e}\n")
    print(report(analyse(trace, a.min_us), top=a.top))


if __name__ == "__main__":
    main()
