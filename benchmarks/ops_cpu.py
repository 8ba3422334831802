"""CPU benchmark of the op layer: chunkwise PyTorch form vs the per-token recurrence.

fp32, (B, T, H, D) = (1, 2048, 8, 64) and (2, 4096, 4, 128), Gated DeltaNet (and the chunk form
of the other members), forward and forward+backward, median of several runs. Prints a markdown
table with the machine and date; the figures in docs/BENCHMARKS.md come from this script.

    python benchmarks/ops_cpu.py [--reps 7] [--loop-reps 3] [--chunk-sizes 64,32]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch

from gdn.ops.delta import chunk as Ch
from gdn.ops.delta import reference as R

SHAPES = [(1, 2048, 8, 64), (2, 4096, 4, 128)]


def inputs(B, T, H, D, grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(B, T, H, generator=gen)) * 0.1
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return [x.requires_grad_(grad) for x in (q, k, v, g, beta)]


def median_ms(fn, reps, warmup=1):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def gdn_flops(B, T, H, D, C):
    """Multiply-adds x2 of the chunk forward as implemented (gdn/ops/delta/chunk.py), per docs/BENCHMARKS.md."""
    chunks = B * H * (T // C)
    per_chunk = (
        2 * C * C * D  # Q Kᵀ and K Kᵀ
        + C * C * C // 3  # triangular inverse
        + 2 * C * C * D  # Tinv [βV, βΓK]
        + C * C * D  # P W
        + 2 * C * D * D  # K̃ᵀ U, K̃ᵀ W
        + D * D * D  # state pass M S
        + C * C * D + C * D * D  # P U + Qw S
    )
    return 2 * chunks * per_chunk


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="timed runs of the chunk form (median reported)")
    ap.add_argument("--loop-reps", type=int, default=3, help="timed runs of the per-token loop")
    ap.add_argument("--chunk-sizes", default="64,32", help="chunk sizes to time, comma-separated")
    args = ap.parse_args()
    sizes = [int(c) for c in args.chunk_sizes.split(",")]
    rows = []
    for B, T, H, D in SHAPES:
        x = inputs(B, T, H, D)
        xg = inputs(B, T, H, D, grad=True)

        def fwd_bwd(fn):
            o, _ = fn(*xg)
            o.sum().backward()

        with torch.no_grad():
            loop_f = median_ms(lambda: R.gated_delta_rule(*x), args.loop_reps, warmup=0)
        loop_fb = median_ms(lambda: fwd_bwd(R.gated_delta_rule), args.loop_reps, warmup=0)
        rows.append(((B, T, H, D), "gated_delta_rule", "per-token loop", "-", loop_f, loop_fb, None))
        for C in sizes:
            with torch.no_grad():
                f = median_ms(lambda: Ch.gated_delta_rule(*x, chunk_size=C), args.reps)
            fb = median_ms(lambda: fwd_bwd(lambda *a: Ch.gated_delta_rule(*a, chunk_size=C)), args.reps)
            rows.append(((B, T, H, D), "gated_delta_rule", "chunk", C, f, fb, gdn_flops(B, T, H, D, C) / f / 1e6))
        for name, extra in (("delta_rule", [x[4]]), ("gated_linear_attention", [x[3]]), ("linear_attention", [])):
            with torch.no_grad():
                f = median_ms(lambda: getattr(Ch, name)(*x[:3], *extra), args.reps)
            rows.append(((B, T, H, D), name, "chunk", 64, f, None, None))
    print(f"# gdn ops on CPU — {datetime.date.today()} — {cpu_name()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32\n")
    print("| (B, T, H, D) | op | form | C | forward ms | fwd+bwd ms | fwd GFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for shape, name, form, C, f, fb, gf in rows:
        fb_s = f"{fb:.1f}" if fb is not None else ""
        gf_s = f"{gf:.0f}" if gf is not None else ""
        print(f"| {shape} | {name} | {form} | {C} | {f:.1f} | {fb_s} | {gf_s} |")


if __name__ == "__main__":
    main()
