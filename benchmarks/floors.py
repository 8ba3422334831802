"""Per-kernel floors of the Triton chunk kernels: the bytes each must move and the FLOPs it must do,
as times at the card's measured ceilings, to set beside the per-kernel profile of
``benchmarks/ops_gpu.py --profile``.

Bytes count each kernel's own inputs read once and outputs written once, in the dtypes the kernels
use (bf16 q/k/v/do and intermediates, fp32 g/β/dγ, dk's fp32 partial between dqk and wy_bwd), not
the re-reads a tiling adds; FLOPs count the matmuls of the chunk algorithm (chunk C = 64). A kernel
near its byte floor can only gain by fusion (fewer bytes); one far above both is latency-bound.

    python benchmarks/floors.py --shape 1,32768,16,128 [--copy-gbs 4240 --tflops 714]
"""
from __future__ import annotations

import argparse

C = 64


def floors(B: int, T: int, H: int, K: int, V: int, HV: int | None = None):
    """{kernel: (bytes, flops)} for one forward + backward at (B, T, H, K, V), bf16, gated."""
    HV = HV or H
    n = B * (T // C) * HV  # (chunk, value head) pairs
    h16, f32 = 2, 4
    tok = C  # tokens per chunk
    qk = tok * K * h16  # one chunk's q or k rows
    vv = tok * V * h16
    st = K * V * h16  # one per-chunk state in bf16
    gb = tok * f32 * 2  # g and β
    a_t = tok * C * h16  # one chunk's rows of T⁻¹
    dk32 = tok * K * f32  # dk's fp32 partial
    out = {
        "kkt_solve": (qk + gb + a_t, 2 * tok * tok * K),
        "wu": (2 * qk + 2 * vv + a_t + gb, 2 * tok * tok * (K + V)),
        "state_fwd": (2 * qk + 2 * vv + st, 4 * tok * K * V),  # W, K, U in; h, δ out
        "output": (2 * qk + st + 2 * vv + tok * f32, 2 * (tok * tok * K + tok * K * V + tok * tok * V)),
        "dv_local": (2 * qk + 2 * vv + tok * f32, 2 * (tok * tok * K + tok * tok * V)),
        "state_bwd": (3 * qk + 3 * vv + st, 6 * tok * K * V),
        "dqk": (4 * qk + 3 * vv + 2 * st + dk32 + 2 * tok * f32, 2 * (tok * tok * V + 3 * tok * K * V + 3 * tok * tok * K)),
        "wy_bwd": (3 * qk + 3 * vv + a_t + dk32 + gb + 3 * tok * f32,
                   2 * (2 * tok * tok * V + 5 * tok * tok * K + 2 * tok ** 3)),
    }
    return {k: (b * n, f * n) for k, (b, f) in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,32768,16,128", help="B,T,H,D (K = V = D) or B,T,H,K,V")
    ap.add_argument("--copy-gbs", type=float, default=4240.0, help="measured copy bandwidth, GB/s")
    ap.add_argument("--tflops", type=float, default=714.0, help="measured bf16 matmul rate, TFLOP/s")
    a = ap.parse_args(argv)
    dims = [int(x) for x in a.shape.split(",")]
    if len(dims) == 4:
        dims.append(dims[3])
    if len(dims) != 5:
        raise ValueError(f"--shape must be B,T,H,D or B,T,H,K,V, got {a.shape!r}")
    B, T, H, K, V = dims
    print(f"floors at (B, T, H, K, V) = {tuple(dims)}, bf16, copy {a.copy_gbs:.0f} GB/s, matmul {a.tflops:.0f} TFLOP/s")
    print("| kernel | MB moved | GFLOP | byte floor µs | FLOP floor µs |")
    print("|---|---:|---:|---:|---:|")
    tb = tf = 0.0
    for name, (nb, nf) in floors(B, T, H, K, V).items():
        ub, uf = nb / (a.copy_gbs * 1e9) * 1e6, nf / (a.tflops * 1e12) * 1e6
        tb, tf = tb + ub, tf + uf
        print(f"| {name} | {nb / 1e6:.0f} | {nf / 1e9:.1f} | {ub:.0f} | {uf:.0f} |")
    print(f"| sum, each kernel once (a fwd+bwd runs wu and state_fwd twice) | | | {tb:.0f} | {tf:.0f} |")


if __name__ == "__main__":
    main()
