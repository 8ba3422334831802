"""Per-kernel floors of the Triton chunk kernels: the bytes each must move and the FLOPs it must do,
as times at the card's measured ceilings, to set beside the per-kernel profile of
``benchmarks/ops_gpu.py --profile``.

Bytes count each kernel's own inputs read once and outputs written once, in the dtypes the kernels
use (bf16 q/k/v/do and intermediates, fp32 g/β/dγ, dk's fp32 partial between dqk and wy_bwd), not
the re-reads a tiling adds; FLOPs count the matmuls of the chunk algorithm (chunk C = 64). A kernel
near its byte floor can only gain by fusion (fewer bytes); one far above both is latency-bound.

    python benchmarks/floors.py --shape 1,32768,16,128 [--copy-gbs 4240 --tflops 714] [--op pair|kda|fused]
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

C = 64


def _byte_floor():
    """tools/byte_floor.py, the floors of the kernels the default path launches on compute capability 9."""
    spec = importlib.util.spec_from_file_location("byte_floor", Path(__file__).resolve().parent.parent / "tools" / "byte_floor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def floors(B: int, T: int, H: int, K: int, V: int, HV: int | None = None, pair: bool = False):
    """{kernel: (bytes, flops)} for one forward + backward at (B, T, H, K, V), bf16, gated, as the
    default launches run it on compute capability 9 (tools/byte_floor.py's model: kkt_solve,
    fused_fwd, fused_states, fused_rev, fused_bwd and, with grouped heads, group_sum). With
    ``pair``, the Triton kernels other GPUs run:
    kkt_solve writing P too, state_out, state_fwd, dv_local, state_bwd, dqk and wy_bwd."""
    HV = HV or H
    if not pair:  # one model of the launched kernels: tools/byte_floor.py's
        return _byte_floor().kernels(B, T, H, HV, K, V)
    n = B * (T // C) * HV  # (chunk, value head) pairs
    h16, f32 = 2, 4
    tok = C  # tokens per chunk
    qk = tok * K * h16  # one chunk's q or k rows
    vv = tok * V * h16
    st = K * V * h16  # one per-chunk state in bf16
    gb = tok * f32 * 2  # g and β
    a_t = tok * C * h16  # one chunk's rows of T⁻¹
    dk32 = tok * K * f32  # dk's fp32 partial
    kv, ttk, ttv = tok * K * V, tok * tok * K, tok * tok * V  # one product's multiply-adds
    out = {
        # forward: T⁻¹ and the output's pair matrix P from q, k; the state-and-output pass forming δ
        # from T⁻¹, v and β
        "kkt_solve": (2 * qk + gb + 2 * a_t, 2 * 2 * ttk),
        "state_out": (2 * qk + 2 * vv + 2 * a_t + gb, 2 * (3 * kv + 2 * ttv)),
        # backward: the state pass again (h and δ stored), dδ_loc, the reverse pass (Wᵀ dδ formed
        # from T⁻¹; dh and dδ stored), then dqk and wy_bwd
        "state_fwd (recompute)": (qk + 2 * vv + a_t + gb + st, 4 * kv + 2 * ttv),
        "dv_local": (2 * qk + 2 * vv + tok * f32, 2 * (ttk + ttv)),
        "state_bwd": (2 * qk + 3 * vv + a_t + gb + st, 6 * kv + 2 * ttv),
        "dqk": (4 * qk + 3 * vv + 2 * st + dk32 + 2 * tok * f32, 2 * (ttv + 3 * kv + 3 * ttk)),
        "wy_bwd": (3 * qk + 3 * vv + a_t + dk32 + gb + 3 * tok * f32, 2 * (2 * ttv + 5 * ttk + 2 * tok ** 3)),
    }
    return {k: (b * n, f * n) for k, (b, f) in out.items()}


def floors_fused(B: int, T: int, H: int, K: int, V: int, HV: int | None = None):
    """{kernel: (bytes, flops)} of a per-chunk fused backward, the design the present kernels point
    to (the forward as now: kkt_solve and the fused state_out pass). Only the per-chunk states h and
    their gradients dh go through memory between the backward's kernels: a state pass stores h
    (δ formed from T⁻¹ in the pass, not stored), a reverse pass stores dh (dδ_loc = scale·Pᵀ dO and
    Wᵀ dδ formed in the pass from q, k, T⁻¹ and β), then one kernel per chunk and value head reads
    q, k, v, dO, T⁻¹, h and dh and writes dq, dk, dv, dβ and dγ, forming δ, dδ, dW, dT and dA on
    chip (what dv_local, dqk and wy_bwd compute now, with none of their intermediates stored)."""
    HV = HV or H
    n = B * (T // C) * HV
    h16, f32 = 2, 4
    tok = C
    qk, vv = tok * K * h16, tok * V * h16
    st = K * V * h16
    gb = tok * f32 * 2
    a_t = tok * C * h16
    out = {
        "kkt_solve": (2 * qk + gb + 2 * a_t, 2 * 2 * tok * tok * K),
        "state_out": (2 * qk + 2 * vv + 2 * a_t + gb, 2 * (3 * tok * K * V + 2 * tok * tok * V)),
        "state_fwd (h only)": (qk + vv + a_t + gb + st, 4 * tok * K * V + 2 * tok * tok * V),
        "state_bwd (dh only)": (2 * qk + vv + a_t + gb + st,
                                6 * tok * K * V + 2 * tok * tok * K + 2 * 2 * tok * tok * V),
        "fused per-chunk backward": (2 * qk + 2 * vv + a_t + gb + 2 * st + 2 * qk + vv + 2 * tok * f32,
                                     2 * (3 * tok * tok * V + 6 * tok * K * V + 6 * tok * tok * K + 2 * tok ** 3)),
    }
    return {k: (b * n, f * n) for k, (b, f) in out.items()}


def floors_kda(B: int, T: int, H: int, K: int, V: int, HV: int | None = None):
    """{kernel: (bytes, flops)} for one forward + backward of the KDA chunk kernels
    (gdn/ops/kda/triton) at (B, T, H, K, V), bf16 inputs and intermediates, fp32 γ, per-chunk states,
    dq/dk/dγ/dv partials and dP, dA (the dtypes those kernels use). The pair matrices A and P
    count their ten lower 16 × 16 blocks (the kernels' sub-blocks)."""
    HV = HV or H
    n = B * (T // C) * HV
    h16, f32 = 2, 4
    tok = C
    qk, vv = tok * K * h16, tok * V * h16
    gam = tok * K * f32  # γ, or one fp32 [C, K] partial (dq, dk, dγ, dg)
    st = K * V * f32  # one per-chunk state (fp32 here)
    vec = tok * f32  # β, dβ
    a_t = tok * C * h16  # one chunk's rows of T⁻¹ or P
    a32 = tok * C * f32  # dP, dA
    pairs = 10 * 16 * 16  # entries of the ten lower sub-blocks
    out = {
        "gamma": (2 * gam, 0),
        "kkt": (2 * qk + gam + vec + 2 * a_t, 2 * 2 * pairs * K),
        "wu": (2 * qk + vv + gam + vec + a_t + 3 * qk + vv, 2 * tok * tok * (K + V)),
        "state_fwd": (2 * qk + vv + st + vv, 4 * tok * K * V),
        "output": (qk + a_t + st + 2 * vv, 2 * (tok * K * V + tok * tok * V)),
        "dv_local": (a_t + 2 * vv, 2 * tok * tok * V),
        "state_bwd": (3 * qk + 3 * vv + st, 6 * tok * K * V),
        "dqk": (2 * qk + gam + 3 * vv + 2 * st + 3 * gam + qk + a32, 2 * (tok * tok * V + 3 * tok * K * V)),
        # wy_bwd writes its dK term (DKW) alone; intra_bwd reads DQ, DK, DGAM (= dγ + k ⊙ dK) and DKW
        # and writes dq, dk and dg
        "wy_bwd": (2 * qk + 2 * vv + gam + vec + a_t + gam + 2 * tok * V * f32 + vec + a32,
                   2 * (2 * tok * tok * V + 2 * tok * tok * K + 2 * tok ** 3)),
        "intra_bwd": (2 * qk + gam + vec + 2 * a32 + 4 * gam + 3 * gam + vec, 4 * 2 * pairs * K),
    }
    return {k: (b * n, f * n) for k, (b, f) in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,32768,16,128", help="B,T,H,D (K = V = D) or B,T,H,K,V")
    ap.add_argument("--copy-gbs", type=float, default=4240.0, help="measured copy bandwidth, GB/s")
    ap.add_argument("--tflops", type=float, default=714.0, help="measured bf16 matmul rate, TFLOP/s")
    ap.add_argument("--op", choices=("delta", "pair", "kda", "fused"), default="delta",
                    help="the scalar-gate kernels as launched on compute capability 9, the Triton kernels "
                         "other GPUs run, KDA's, or the per-chunk fused backward's design (floors_fused)")
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
    table = {"delta": floors, "pair": lambda *d: floors(*d, pair=True), "kda": floors_kda,
             "fused": floors_fused}[a.op]
    for name, (nb, nf) in table(B, T, H, K, V).items():
        ub, uf = nb / (a.copy_gbs * 1e9) * 1e6, nf / (a.tflops * 1e12) * 1e6
        tb, tf = tb + ub, tf + uf
        print(f"| {name} | {nb / 1e6:.0f} | {nf / 1e9:.1f} | {ub:.0f} | {uf:.0f} |")
    what = "sum, each kernel once"
    print(f"| {what} | | | {tb:.0f} | {tf:.0f} |")
    if a.op == "kda":
        print("(FLOPs: the chunk algorithm's matmuls; KDA's exponentials, [C, K] per sub-block and operand, run on the"
              " special-function units and are not counted)")


if __name__ == "__main__":
    main()
