"""Host (Python) time of one chunk-op call against its GPU time, and where the host time goes.

A call whose host side takes longer than its kernels leaves the GPU idle between launches, and
``do_bench`` then times the host. This prints, per pass at one shape: the host µs per call (calls
queued back to back, timed before the final synchronisation), the GPU µs per call (the same calls
replayed from a CUDA graph where capture works, else the sum of the profiled kernels), and the
functions with the most own and cumulative host time (cProfile).

    python tools/host_profile.py --shape 8x2048 [--heads 16 --hv 16] [--top 25]

The inputs and the call are benchmarks/ops_gpu.py's (bf16, K = V = 128).

With ``--cpu-stub`` (no GPU needed) the same calls take the Triton path on CPU tensors with every
kernel launch replaced by a no-op: what is left is gdn's own host work per call (argument checks,
chunk layout, tile and pass choices, allocations), without Triton's launch path or the CUDA
runtime. Its outputs are garbage; only the time is meant.
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

if "--cpu-stub" in sys.argv:  # before triton is imported: its interpreter takes CPU tensors
    import os

    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ops_gpu import D, gdn_fn, inputs, kernel_events  # noqa: E402

DEVICE = "cpu" if "--cpu-stub" in sys.argv else "cuda"
LAUNCHES = [0]


def stub_launches() -> None:
    """Every Triton launch a no-op (counted), and the router's CUDA test true for CPU tensors."""
    import triton.runtime.interpreter as interp
    from triton.runtime.jit import JITFunction

    def getitem(self, grid):
        def run(*args, **kwargs):
            LAUNCHES[0] += 1
        return run

    JITFunction.__getitem__ = getitem
    interp.InterpretedFunction.__getitem__ = getitem
    for mod in list(sys.modules.values()):  # the router and every module that imported its test
        if getattr(mod, "__name__", "").startswith("gdn.") and hasattr(mod, "use_triton"):
            mod.use_triton = lambda x: True


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def host_us(fn, n=50) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(3):  # best of three rounds: a loaded host's stalls are not the code's cost
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
        sync()
    return best / n * 1e6


def gpu_us(fn, n=50) -> float:
    """Kernel µs per call from the profiler (every CUDA kernel's time, summed)."""
    return kernel_events(fn, n)[1]


def top(fn, k: int) -> str:
    fn()
    sync()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        fn()
    pr.disable()
    sync()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(k)
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(k)
    return s.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8x2048", help="BxT")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--hv", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--cpu-stub", action="store_true", help="CPU tensors, kernel launches as no-ops: gdn's own host time")
    a = p.parse_args(argv)
    if a.cpu_stub:
        stub_launches()
    B, T = (int(x) for x in a.shape.lower().split("x"))
    xs, _ = inputs(B, T, a.heads, a.hv, None, device=DEVICE)
    do = torch.randn(B, T, a.hv, D, device=DEVICE, dtype=torch.bfloat16)
    fwd = gdn_fn(xs, None)

    def fwd_nograd():
        with torch.no_grad():
            return fwd()

    def fwd_bwd():
        for x in xs:
            x.grad = None
        fwd().backward(do)

    where = "CPU, launches stubbed" if a.cpu_stub else torch.cuda.get_device_name()
    print(f"shape ({B}, {T}, H={a.heads}, HV={a.hv}, {D}) bf16; torch {torch.__version__}, {where}")
    for name, fn in (("forward, no grad", fwd_nograd), ("forward", fwd), ("forward+backward", fwd_bwd)):
        if a.cpu_stub:
            fn()
            LAUNCHES[0] = 0
            fn()
            n = LAUNCHES[0]
            print(f"{name:18s} host {host_us(fn):8.1f} µs/call   ({n} launches)")
        else:
            print(f"{name:18s} host {host_us(fn):8.1f} µs/call   GPU kernels {gpu_us(fn):8.1f} µs/call")
    for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        print(f"\n== {name}: own host time, 20 calls\n{top(fn, a.top)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
