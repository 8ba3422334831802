"""Whether loading and running a peer slows gdn's host path in the same process: gdn's host µs per
call (best of three rounds, the GPU synchronised after each) and its wall time (`triton.testing.
do_bench` medians, as benchmarks/ops_gpu.py times) at each shape, forward and forward + backward,
in four states of one process: gdn alone, after importing the peer, after the peer's first forward +
backward, and after ``gc.freeze()``; with the process's threads and their CPU use over one idle
second in each state (a peer's worker threads spinning would show there). GPU only:

    python tools/peer_host.py --peer qla --shapes 1x32768,8x2048

(FlashQLA's wheels installed as for ops_gpu.py; with ``TILELANG_CACHE_DIR`` holding its kernels of
an earlier run, its first call loads them instead of compiling).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks"), os.path.dirname(os.path.abspath(__file__))]

PEERS = ("qla", "fla")


def thread_ticks(task_dir: str = "/proc/self/task") -> dict:
    """{thread id: (name, user + system clock ticks so far)} of this process (Linux /proc)."""
    out = {}
    for t in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{task_dir}/{t}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[t] = (name, int(fields[11]) + int(fields[12]))  # utime, stime: fields 14 and 15 of stat
    return out


def busiest(before: dict, after: dict, top: int = 4) -> list:
    """[(ticks, name)] of the threads that used the most CPU between two :func:`thread_ticks`."""
    return sorted(((after[t][1] - before[t][1], after[t][0]) for t in after if t in before), reverse=True)[:top]


def idle_line(label: str) -> str:
    a = thread_ticks()
    time.sleep(1.0)
    b = thread_ticks()
    return f"{label}: {len(b)} threads, CPU ticks over one idle second (busiest): {busiest(a, b)}"


def measure(label: str, rows) -> None:
    from triton.testing import do_bench  # noqa: PLC0415

    from host_profile import host_us  # noqa: PLC0415  (best of three rounds, synchronised after each)

    for name, f, xs, do in rows:
        def fwd_bwd():
            for x in xs:
                x.grad = None
            f().backward(do)

        with torch.no_grad():
            hf = host_us(f, 30)
            wf = do_bench(f, warmup=5, rep=60, return_mode="median")
        hb = host_us(fwd_bwd, 30)
        wb = do_bench(lambda: f().backward(do), warmup=5, rep=60, grad_to_none=xs, return_mode="median")
        print(f"| {label} | {name} | {hf:.0f} | {wf * 1e3:.0f} | {hb:.0f} | {wb * 1e3:.0f} |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", default="qla", choices=PEERS)
    p.add_argument("--shapes", default="1x32768,8x2048", help="BxT,... (H = HV = 16, K = V = 128)")
    a = p.parse_args(argv)
    try:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in a.shapes.split(",")]
        assert shapes and all(len(s) == 2 and min(s) > 0 for s in shapes)
    except (ValueError, AssertionError):
        p.error(f"--shapes: expected BxT[,BxT...] with positive integers, got {a.shapes!r}")
    if not torch.cuda.is_available():
        print("peer_host: needs CUDA", file=sys.stderr)
        return 2
    from ops_gpu import fla_fn, gdn_fn, inputs, qla_fn  # noqa: PLC0415

    rows = []
    for B, T in shapes:
        xs, cu = inputs(B, T, 16, 16, None)
        do = torch.randn(B, T, 16, 128, device="cuda", dtype=torch.bfloat16)
        rows.append((f"{B}x{T}", gdn_fn(xs, cu), xs, do))
    for _, f, _, do in rows:  # compile
        f().backward(do)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; gdn host µs per call and wall µs")
    print("\n| state | shape | fwd host | fwd wall | fwd+bwd host | fwd+bwd wall |\n|---|---|---|---|---|---|")
    notes = [idle_line("gdn alone")]
    measure("gdn alone", rows)
    t0 = time.perf_counter()
    if a.peer == "qla":
        import flash_qla  # noqa: F401, PLC0415
    else:
        import fla  # noqa: F401, PLC0415
    notes.append(f"imported {a.peer} in {time.perf_counter() - t0:.1f} s")
    notes.append(idle_line(f"after importing {a.peer}"))
    measure(f"after importing {a.peer}", rows)
    t0 = time.perf_counter()
    for _, _, xs, do in rows:
        peer = (qla_fn if a.peer == "qla" else fla_fn)(xs, None)
        peer().backward(do)
    torch.cuda.synchronize()
    notes.append(f"{a.peer}'s first forward + backward at every shape: {time.perf_counter() - t0:.1f} s")
    notes.append(idle_line(f"after {a.peer} ran"))
    measure(f"after {a.peer} ran", rows)
    n = len(gc.get_objects())
    t0 = time.perf_counter()
    gc.collect()
    notes.append(f"gc: {n} tracked objects, a full collection {1e3 * (time.perf_counter() - t0):.0f} ms")
    gc.freeze()
    measure("after gc.freeze()", rows)
    print("\n" + "\n".join(notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
