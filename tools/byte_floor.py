"""Each chunk kernel's floor for one forward + backward of the gated delta rule: the bytes it must
read and write (each tensor it touches once) and its matrix-product FLOPs, against the card's copy
bandwidth and matmul rate. The kernels are those of the default path on compute capability 9 in
16 bits (kkt_solve, state_out; then the backward's state_fwd, dv_local, state_bwd, fused_bwd).

    python tools/byte_floor.py --shape 8,2048,16,16,128,128 --measured fused_bwd=488,state_bwd=249

prints a table: MB moved, GFLOP, the floor in µs (the larger of bytes / bandwidth and FLOPs /
rate) and, for each kernel given a measured time (µs, e.g. from ``benchmarks/ops_gpu.py
--profile``), that time over its floor. Nothing runs: the model is the kernels' reads and writes
as their docstrings state them.
"""
from __future__ import annotations

import argparse
import sys

BT = 64  # chunk rows


def kernels(B: int, T: int, H: int, HV: int, K: int, V: int, io: int = 2) -> dict:
    """{kernel: (bytes read and written, matmul FLOPs)} of one forward + backward; ``io`` bytes per
    element of q, k, v and the intermediates (fp32 for γ, β, dβ, dg)."""
    N = B * T  # tokens
    NT = B * -(-T // BT)  # chunks
    qk = 2 * N * H * K * io  # q and k
    tv = N * HV * V * io  # one [tokens, HV, V] tensor (v, o, δ, dO, dδ, dV)
    tk = N * HV * K * io  # one [tokens, HV, K] tensor (dQ, dK per value head)
    t64 = N * HV * BT * io  # the in-chunk inverse rows, or the pair matrix's
    vec = N * HV * 4  # one fp32 [tokens, HV] (g, γ, β, dβ, dg)
    st = NT * HV * K * V * io  # per-chunk states (h or dh)
    blocks = NT * HV  # (chunk, value head) blocks

    def mm(*shapes):  # FLOPs of the products [m, k] × [k, n] over every block
        return blocks * sum(2 * m * n * k for m, n, k in shapes)

    return {
        "kkt_solve": (qk + 2 * vec + 2 * t64 + vec, mm((BT, BT, K), (BT, BT, K))),
        "state_out": (qk + tv + 2 * t64 + 2 * vec + tv,
                      mm((BT, V, K), (BT, V, BT), (K, V, BT), (BT, V, K), (BT, V, BT))),
        "state_fwd": (N * H * K * io + tv + t64 + 2 * vec + st + tv, mm((BT, V, K), (BT, V, BT), (K, V, BT))),
        "dv_local": (qk + vec + tv + tv, mm((BT, BT, K), (BT, V, BT))),
        "state_bwd": (qk + tv + tv + t64 + 2 * vec + st + tv,
                      mm((BT, V, K), (BT, V, BT), (K, V, BT), (K, V, BT))),
        "fused_bwd": (qk + 4 * tv + 2 * st + t64 + 2 * vec + 2 * tk + tv + 2 * vec,
                      mm((BT, BT, V), (BT, BT, V), (BT, K, V), (BT, K, V), (BT, K, V), (BT, V, BT),
                         (BT, BT, K), (BT, BT, K), (BT, K, BT), (BT, BT, BT), (BT, BT, BT), (BT, K, BT),
                         (BT, K, BT), (BT, K, BT), (BT, K, BT))),
    }


def table(shape, bandwidth: float, rate: float, measured: dict) -> str:
    rows = ["| kernel | MB moved | GFLOP | floor µs | measured µs | × floor |", "|---|---|---|---|---|---|"]
    tot_f = tot_m = 0.0
    for name, (nb, fl) in kernels(*shape).items():
        floor = max(nb / bandwidth, fl / rate) * 1e6
        tot_f += floor
        got = measured.get(name)
        tot_m += got or 0.0
        rows.append(f"| {name} | {nb / 1e6:.0f} | {fl / 1e9:.1f} | {floor:.0f} | "
                    f"{'' if got is None else f'{got:.0f}'} | {'' if got is None else f'{got / floor:.1f}'} |")
    rows.append(f"| total | | | {tot_f:.0f} | {tot_m:.0f} | {tot_m / tot_f:.1f} |" if measured else
                f"| total | | | {tot_f:.0f} | | |")
    return "\n".join(rows)


NAMES = tuple(kernels(1, BT, 1, 1, 16, 16))  # the kernels of the model, in launch order


def parse_measured(text: str | None) -> dict:
    """``name=µs,name=µs`` as {name: µs}; a name that is no kernel of the model raises ValueError."""
    out = {}
    for part in filter(None, (text or "").split(",")):
        name, sep, val = part.partition("=")
        if not sep or name.strip() not in NAMES:
            raise ValueError(f"--measured: expected kernel=µs with a kernel of {sorted(NAMES)}, got {part!r}")
        out[name.strip()] = float(val)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8,2048,16,16,128,128", help="B,T,H,HV,K,V")
    ap.add_argument("--bandwidth", type=float, default=4.24e12, help="copy bytes/s (the H200's measured: 4.24e12)")
    ap.add_argument("--rate", type=float, default=686e12, help="bf16 matmul FLOP/s (the H200's measured: 686e12)")
    ap.add_argument("--measured", default=None, help="measured µs per kernel: name=µs,name=µs")
    a = ap.parse_args(argv)
    try:
        shape = tuple(int(x) for x in a.shape.split(","))
        if len(shape) != 6 or min(shape) < 1:
            raise ValueError
    except ValueError:
        print(f"byte_floor: --shape: expected six positive integers B,T,H,HV,K,V, got {a.shape!r}", file=sys.stderr)
        return 2
    try:
        measured = parse_measured(a.measured)
    except ValueError as e:
        print(f"byte_floor: {e}", file=sys.stderr)
        return 2
    print(f"shape (B, T, H, HV, K, V) = {shape}, 16-bit, {a.bandwidth / 1e12:.2f} TB/s, {a.rate / 1e12:.0f} TFLOP/s")
    print(table(shape, a.bandwidth, a.rate, measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
