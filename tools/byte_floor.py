"""Each chunk kernel's floor for one forward + backward of the gated delta rule: the bytes it must
read and write (each tensor it touches once; q and k once per key head) and its matrix-product
FLOPs, against the card's copy bandwidth and matmul rate. The kernels are those of the default path
on compute capability 9 in 16 bits at K and V of 64 or 128: kkt_solve and the warp-specialised
forward pass (fused_fwd); then the backward's recomputed state pass (fused_states, the same kernel
storing h and δ), the warp-specialised reverse pass (fused_rev), the per-chunk fused backward
(fused_bwd) and, for grouped value heads, the sum of each key head's dq and dk (group_sum). With
``--merged``, the merged backward (fused_rbwd) in place of fused_rev and fused_bwd: the same
products, without dh and dδ written and read back.

    python tools/byte_floor.py --shape 8,2048,16,16,128,128 --measured fused_bwd=537,fused_rev=164
    python tools/byte_floor.py --shape 8,2048,16,16,128,128 --merged --measured fused_rbwd=814

prints a table: MB moved, GFLOP, the floor in µs (the larger of bytes / bandwidth and FLOPs /
rate) and, for each kernel given a measured time (µs, e.g. from ``benchmarks/ops_gpu.py
--profile``: its fwd+bwd ``fused_fwd_kernel`` line is fused_fwd and fused_states together, its
fwd line fused_fwd alone), that time over its floor. Nothing runs: the model is the kernels' reads
and writes as their docstrings state them. The warm-started split's warm_plan and its warm-up walks
(work the unsplit passes do not do: a few bytes per chunk walked, the bounds kkt_solve stores) are
outside the model.
"""
from __future__ import annotations

import argparse
import sys

BT = 64  # chunk rows


def kernels(B: int, T: int, H: int, HV: int, K: int, V: int, io: int = 2, merged: bool = False) -> dict:
    """{kernel: (bytes read and written, matmul FLOPs)} of one forward + backward; ``io`` bytes per
    element of q, k, v and the intermediates (fp32 for γ, β, dβ, dg); ``merged``: the merged
    backward (fused_rbwd) instead of fused_rev and fused_bwd."""
    N = B * T  # tokens
    NT = B * -(-T // BT)  # chunks
    qk1 = N * H * K * io  # q or k
    tv = N * HV * V * io  # one [tokens, HV, V] tensor (v, o, δ, dO, dδ, dV)
    tk = N * HV * K * io  # one [tokens, HV, K] tensor (dQ or dK per value head)
    t64 = N * HV * BT * io  # the in-chunk inverse's rows
    vec = N * HV * 4  # one fp32 [tokens, HV] (g, γ, β, dβ, dg)
    st = NT * HV * K * V * io  # per-chunk states (h or dh)
    blocks = NT * HV  # (chunk, value head) blocks

    def mm(*shapes):  # FLOPs of the products [m, k] × [k, n] over every block
        return blocks * sum(2 * m * n * k for m, n, k in shapes)

    solve = blocks * 2 * BT ** 3 // 6  # (I + A)⁻¹ of a unit lower triangular [64, 64]
    out = {
        # k, g, β in; T⁻¹, γ and each chunk's log norm bound out; K Kᵀ and the solve
        "kkt_solve": (qk1 + 2 * vec + t64 + vec + blocks * 4, mm((BT, BT, K)) + solve),
        # q, k, v, T⁻¹, γ, β in; o out; per chunk K S, δ = T X, P = Q Kᵀ, Q S, P δ, Kᵀ δ̃
        "fused_fwd": (2 * qk1 + tv + t64 + 2 * vec + tv,
                      mm((BT, V, K), (BT, V, BT), (BT, BT, K), (BT, V, K), (BT, V, BT), (K, V, BT))),
        # k, v, T⁻¹, γ, β in; h and δ out; K S, T X, Kᵀ δ̃
        "fused_states": (qk1 + tv + t64 + 2 * vec + st + tv, mm((BT, V, K), (BT, V, BT), (K, V, BT))),
        # q, k, dO, T⁻¹, γ, β in; dh and dδ out; Pᵀ = K Qᵀ, Pᵀ dO, K dS, Tᵀ dδ, Qᵀ dÕ, Kᵀ Z
        "fused_rev": (2 * qk1 + tv + t64 + 2 * vec + st + tv,
                      mm((BT, BT, K), (BT, V, BT), (BT, V, K), (BT, V, BT), (K, V, BT), (K, V, BT))),
        # q, k, δ, dO, dδ, v, h, dh, T⁻¹, γ, β in; dQ, dK (per value head), dV, dβ, dg out
        "fused_bwd": (2 * qk1 + 4 * tv + 2 * st + t64 + 2 * vec + 2 * tk + tv + 2 * vec,
                      mm((BT, BT, V), (BT, BT, V), (BT, K, V), (BT, K, V), (BT, K, V), (BT, V, BT),
                         (BT, BT, K), (BT, BT, K), (BT, K, BT), (BT, BT, BT), (BT, BT, BT), (BT, K, BT),
                         (BT, K, BT), (BT, K, BT), (BT, K, BT))),
    }
    if merged:
        # q, k, dO, T⁻¹, δ, h, v, γ, β in; dQ, dK (per value head), dV, dβ, dg out: the two kernels'
        # products, without dh and dδ between them
        rev, bwd = out.pop("fused_rev"), out.pop("fused_bwd")
        out["fused_rbwd"] = (2 * qk1 + 3 * tv + st + t64 + 2 * vec + 2 * tk + tv + 2 * vec, rev[1] + bwd[1])
    if HV > H:  # each key head's dq and dk summed over its value heads
        out["group_sum"] = (2 * tk + 2 * qk1, 0)
    return out


def table(shape, bandwidth: float, rate: float, measured: dict, merged: bool = False) -> str:
    rows = ["| kernel | MB moved | GFLOP | floor µs | measured µs | × floor |", "|---|---|---|---|---|---|"]
    tot_f = tot_m = 0.0
    for name, (nb, fl) in kernels(*shape, merged=merged).items():
        floor = max(nb / bandwidth, fl / rate) * 1e6
        tot_f += floor
        got = measured.get(name)
        tot_m += got or 0.0
        rows.append(f"| {name} | {nb / 1e6:.0f} | {fl / 1e9:.1f} | {floor:.0f} | "
                    f"{'' if got is None else f'{got:.0f}'} | {'' if got is None else f'{got / floor:.1f}'} |")
    rows.append(f"| total | | | {tot_f:.0f} | {tot_m:.0f} | {tot_m / tot_f:.1f} |" if measured else
                f"| total | | | {tot_f:.0f} | | |")
    return "\n".join(rows)


def parse_measured(text: str | None, names) -> dict:
    """``name=µs,name=µs`` as {name: µs}; a name not among ``names`` (the kernels of the path
    modelled) raises ValueError."""
    out = {}
    for part in filter(None, (text or "").split(",")):
        name, sep, val = part.partition("=")
        if not sep or name.strip() not in names:
            raise ValueError(f"--measured: expected kernel=µs with a kernel of this path ({', '.join(names)}), "
                             f"got {part!r}")
        out[name.strip()] = float(val)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8,2048,16,16,128,128", help="B,T,H,HV,K,V")
    ap.add_argument("--bandwidth", type=float, default=4.24e12, help="copy bytes/s (the H200's measured: 4.24e12)")
    ap.add_argument("--rate", type=float, default=686e12, help="bf16 matmul FLOP/s (the H200's measured: 686e12)")
    ap.add_argument("--measured", default=None, help="measured µs per kernel: name=µs,name=µs")
    ap.add_argument("--merged", action="store_true", help="the merged backward (fused_rbwd) in place of fused_rev "
                                                          "and fused_bwd")
    a = ap.parse_args(argv)
    try:
        shape = tuple(int(x) for x in a.shape.split(","))
        if len(shape) != 6 or min(shape) < 1:
            raise ValueError
    except ValueError:
        print(f"byte_floor: --shape: expected six positive integers B,T,H,HV,K,V, got {a.shape!r}", file=sys.stderr)
        return 2
    try:
        measured = parse_measured(a.measured, tuple(kernels(*shape, merged=a.merged)))
    except ValueError as e:
        print(f"byte_floor: {e}", file=sys.stderr)
        return 2
    print(f"shape (B, T, H, HV, K, V) = {shape}, 16-bit, {a.bandwidth / 1e12:.2f} TB/s, {a.rate / 1e12:.0f} TFLOP/s")
    print(table(shape, a.bandwidth, a.rate, measured, a.merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
