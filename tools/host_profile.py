"""Host (Python) time of one chunk-op call against its GPU time, and where the host time goes.

A call whose host side takes longer than its kernels leaves the GPU idle between launches, and
``do_bench`` then times the host. This prints, per pass at one shape: the host µs per call (calls
queued back to back, timed before the final synchronisation), the GPU µs per call (the same calls
replayed from a CUDA graph where capture works, else the sum of the profiled kernels), and the
functions with the most own and cumulative host time (cProfile).

    python tools/host_profile.py --shape 8x2048 [--heads 16 --hv 16 --dim 128] [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gdn import ops  # noqa: E402


def make(B, T, H, HV, D):
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, D, device="cuda", dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda") + 3)
    beta = torch.rand(B, T, HV, device="cuda").sigmoid()
    return [x.requires_grad_(True) for x in (q, k, v, g, beta)]


def host_us(fn, n=50) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / n * 1e6


def gpu_us(fn, n=50) -> float:
    """Kernel µs per call from the profiler (every CUDA kernel's time, summed)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return total / n


def top(fn, k: int) -> str:
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(k)
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(k)
    return s.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8x2048", help="BxT")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--hv", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    B, T = (int(x) for x in a.shape.lower().split("x"))
    xs = make(B, T, a.heads, a.hv, a.dim)
    do = torch.randn(B, T, a.hv, a.dim, device="cuda", dtype=torch.bfloat16)

    def fwd_nograd():
        with torch.no_grad():
            return ops.gated_delta_rule(*xs, backend="triton")[0]

    def fwd():
        return ops.gated_delta_rule(*xs, backend="triton")[0]

    def fwd_bwd():
        for x in xs:
            x.grad = None
        fwd().backward(do)

    print(f"shape ({B}, {T}, H={a.heads}, HV={a.hv}, {a.dim}) bf16; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}")
    for name, fn in (("forward, no grad", fwd_nograd), ("forward", fwd), ("forward+backward", fwd_bwd)):
        print(f"{name:18s} host {host_us(fn):8.1f} µs/call   GPU kernels {gpu_us(fn):8.1f} µs/call")
    for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        print(f"\n== {name}: own host time, 20 calls\n{top(fn, a.top)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
