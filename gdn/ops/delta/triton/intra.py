"""The per-chunk kernels that come before the state pass (delta members): the in-chunk inverse
T = (I + tril(diag(β)(K Kᵀ ⊙ D), −1))⁻¹ (``kkt_solve_kernel``, which also forms γ and the output's
pair matrix Q Kᵀ ⊙ D when asked), and W = T diag(βΓ) K, U = T diag(β) V (``wu_kernel``, run only
where a state pass reads W and U instead of forming δ from T). Launched by
:func:`.chunk_fwd.prepare`; the math is in :mod:`.chunk_fwd`'s docstring.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...triton.common import chunk_bounds, gate_cumsum, solve_blocks, store_blocks


@triton.jit
def _block_a(Aij, b_i, gi, gj, DIAG: tl.constexpr, USE_G: tl.constexpr):
    """Scale the raw block K_i K_jᵀ into A_ij = β_i (k_i·k_j) exp(γ_i − γ_j); a diagonal block (DIAG)
    keeps its strict lower triangle."""
    o = tl.arange(0, 16)
    keep = o[:, None] > o[None, :]
    if USE_G:
        if DIAG:
            Aij = Aij * tl.exp(tl.where(keep, gi[:, None] - gj[None, :], float("-inf")))
        else:
            Aij = Aij * tl.exp(gi[:, None] - gj[None, :])
    elif DIAG:
        Aij = tl.where(keep, Aij, 0.0)
    return Aij * b_i[:, None]


@triton.jit
def _lower_dots(X00, X10, X11, X20, X21, X22, X30, X31, X32, X33, a0, a1, a2, a3, b0, b1, b2, b3,
                PREC: tl.constexpr):
    """The ten lower 16 × 16 blocks of [a0; a1; a2; a3] [b0; b1; b2; b3]ᵀ added to X00 … X33."""
    return (X00 + tl.dot(a0, tl.trans(b0), input_precision=PREC), X10 + tl.dot(a1, tl.trans(b0), input_precision=PREC),
            X11 + tl.dot(a1, tl.trans(b1), input_precision=PREC), X20 + tl.dot(a2, tl.trans(b0), input_precision=PREC),
            X21 + tl.dot(a2, tl.trans(b1), input_precision=PREC), X22 + tl.dot(a2, tl.trans(b2), input_precision=PREC),
            X30 + tl.dot(a3, tl.trans(b0), input_precision=PREC), X31 + tl.dot(a3, tl.trans(b1), input_precision=PREC),
            X32 + tl.dot(a3, tl.trans(b2), input_precision=PREC), X33 + tl.dot(a3, tl.trans(b3), input_precision=PREC))


@triton.jit
def _stretch(Aii, b_i):
    """Σ_t log max(1, |1 − β_t‖k_t‖²|) over one diagonal Gram block's rows (‖k_t‖² its diagonal; 0
    on padded rows, whose β is 0)."""
    o = tl.arange(0, 16)
    nk = tl.sum(tl.where(o[:, None] == o[None, :], Aii, 0.0), axis=1)
    return tl.sum(tl.log(tl.maximum(tl.abs(1.0 - b_i * nk), 1.0)), axis=0)


@triton.jit
def kkt_solve_kernel(k, g, beta, Ai, G, q, P, Bnd, cu, chunk_idx, H, HV, K: tl.constexpr,
                     BK: tl.constexpr, USE_G: tl.constexpr, PREC: tl.constexpr, INV: tl.constexpr,
                     STORE_G: tl.constexpr, STORE_P: tl.constexpr = False, STORE_B: tl.constexpr = False):
    """Ai[t, hv, :] = rows of T = (I + A)⁻¹ for each chunk, built from four 16-row blocks. With
    STORE_G, also G[t, hv] = γ, the in-chunk cumulative log decay this kernel forms anyway (the
    sequential passes read it, so the call needs no cumsum kernel). With STORE_P, also
    P[t, hv, :] = rows of (Q Kᵀ ⊙ D) with D_ij = exp(γ_i − γ_j) for j ≤ i, else 0: the output's
    in-chunk pair matrix, made here from the same K tiles and γ instead of once per value tile
    in the fused forward pass. With STORE_B (gated), also Bnd[i_t, hv] = the chunk's log norm
    bound (split.bound_kernel's: γ_C + Σ_t log max(1, |1 − β_t‖k_t‖²|)), ‖k_t‖² read off the
    diagonal of the Gram blocks this kernel forms anyway: the warm-started split's walks then
    read one number per chunk instead of the chunk's keys."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_bounds(cu, chunk_idx, i_t, 64)
    o = tl.arange(0, 16)
    r0 = t0 + o
    r1 = r0 + 16
    r2 = r0 + 32
    r3 = r0 + 48
    m0, m1, m2, m3 = r0 < eos, r1 < eos, r2 < eos, r3 < eos
    b0 = tl.load(beta + r0 * HV + i_hv, mask=m0, other=0.0).to(tl.float32)
    b1 = tl.load(beta + r1 * HV + i_hv, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(beta + r2 * HV + i_hv, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(beta + r3 * HV + i_hv, mask=m3, other=0.0).to(tl.float32)
    # g's raw loads first, its scans after the Gram loop: the scans' shuffles would otherwise wait
    # on these loads before the keys' loads are even issued (the prologue held a fifth of the
    # kernel's stall samples, ncu on an H100 at Qwen3.5-397B)
    if USE_G:
        e0 = tl.load(g + r0 * HV + i_hv, mask=m0, other=0.0).to(tl.float32)
        e1 = tl.load(g + r1 * HV + i_hv, mask=m1, other=0.0).to(tl.float32)
        e2 = tl.load(g + r2 * HV + i_hv, mask=m2, other=0.0).to(tl.float32)
        e3 = tl.load(g + r3 * HV + i_hv, mask=m3, other=0.0).to(tl.float32)
    if STORE_P:
        # one whole-chunk [64, BK] × [BK, 64] product in its own loop, stored before the A blocks
        # exist: accumulated beside them (ten 16 × 16 blocks each) ptxas spills 68 + 72 B at sm_90
        rr = t0 + tl.arange(0, 64)
        mr = rr < eos
        b_p = tl.zeros([64, 64], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            mrk = mr[:, None] & (o_k < K)[None, :]
            b_q = tl.load(q + (rr[:, None] * H + i_h) * K + o_k[None, :], mask=mrk, other=0.0)
            b_kj = tl.load(k + (rr[:, None] * H + i_h) * K + o_k[None, :], mask=mrk, other=0.0)
            b_p += tl.dot(b_q, tl.trans(b_kj), input_precision=PREC)
        keep = rr[:, None] >= rr[None, :]
        if USE_G:
            gg, _ = gate_cumsum(g, rr, mr, HV, i_hv)
            b_p = b_p * tl.exp(tl.where(keep, gg[:, None] - gg[None, :], float("-inf")))
        else:
            b_p = tl.where(keep, b_p, 0.0)
        tl.store(P + (rr[:, None] * HV + i_hv) * 64 + tl.arange(0, 64)[None, :], b_p.to(P.dtype.element_ty),
                 mask=mr[:, None])
    z = tl.zeros([16, 16], dtype=tl.float32)
    A00, A10, A11, A20, A21, A22, A30, A31, A32, A33 = z, z, z, z, z, z, z, z, z, z
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mk = o_k < K
        # the row blocks' loads written out, not through a helper: with one, ptxas (sm_90, bf16)
        # spills 120 + 124 B here instead of 68 + 72
        k0 = tl.load(k + (r0[:, None] * H + i_h) * K + o_k[None, :], mask=m0[:, None] & mk[None, :], other=0.0)
        k1 = tl.load(k + (r1[:, None] * H + i_h) * K + o_k[None, :], mask=m1[:, None] & mk[None, :], other=0.0)
        k2 = tl.load(k + (r2[:, None] * H + i_h) * K + o_k[None, :], mask=m2[:, None] & mk[None, :], other=0.0)
        k3 = tl.load(k + (r3[:, None] * H + i_h) * K + o_k[None, :], mask=m3[:, None] & mk[None, :], other=0.0)
        A00, A10, A11, A20, A21, A22, A30, A31, A32, A33 = _lower_dots(
            A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, k0, k1, k2, k3, k0, k1, k2, k3, PREC)
    g0 = tl.zeros([16], dtype=tl.float32)
    g1 = g0
    g2 = g0
    g3 = g0
    s = 0.0
    s3 = 0.0
    if USE_G:
        g0 = tl.cumsum(e0, axis=0)
        s = tl.sum(e0, axis=0)
        g1 = tl.cumsum(e1, axis=0) + s
        s += tl.sum(e1, axis=0)
        g2 = tl.cumsum(e2, axis=0) + s
        s += tl.sum(e2, axis=0)
        g3 = tl.cumsum(e3, axis=0) + s
        s3 = tl.sum(e3, axis=0)
        if STORE_G:
            tl.store(G + r0 * HV + i_hv, g0, mask=m0)
            tl.store(G + r1 * HV + i_hv, g1, mask=m1)
            tl.store(G + r2 * HV + i_hv, g2, mask=m2)
            tl.store(G + r3 * HV + i_hv, g3, mask=m3)
    if STORE_B:
        # reduced to one number before the blocks are scaled: nothing more stays live through the solve
        bnd = s + s3 + _stretch(A00, b0) + _stretch(A11, b1) + _stretch(A22, b2) + _stretch(A33, b3)
        tl.store(Bnd + i_t * HV + i_hv, bnd)
    A00 = _block_a(A00, b0, g0, g0, True, USE_G)
    A11 = _block_a(A11, b1, g1, g1, True, USE_G)
    A22 = _block_a(A22, b2, g2, g2, True, USE_G)
    A33 = _block_a(A33, b3, g3, g3, True, USE_G)
    A10 = _block_a(A10, b1, g1, g0, False, USE_G)
    A20 = _block_a(A20, b2, g2, g0, False, USE_G)
    A21 = _block_a(A21, b2, g2, g1, False, USE_G)
    A30 = _block_a(A30, b3, g3, g0, False, USE_G)
    A31 = _block_a(A31, b3, g3, g1, False, USE_G)
    A32 = _block_a(A32, b3, g3, g2, False, USE_G)
    X00, X10, X11, X20, X21, X22, X30, X31, X32, X33 = solve_blocks(A00, A10, A11, A20, A21, A22, A30, A31, A32,
                                                                    A33, INV)
    store_blocks(Ai, X00, X10, X11, X20, X21, X22, X30, X31, X32, X33, r0, r1, r2, r3, m0, m1, m2, m3, HV, i_hv)


@triton.jit
def wu_kernel(k, v, g, beta, Ai, W, U, cu, chunk_idx, H, HV, K: tl.constexpr,
              V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
              PREC: tl.constexpr, DT: tl.constexpr):
    """W = T diag(βΓ) K and U = T diag(β) V for one chunk and value head (stored in DT)."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_bounds(cu, chunk_idx, i_t, BT)
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    m = rows < eos
    b_A = tl.load(Ai + (rows[:, None] * HV + i_hv) * BT + o_t[None, :], mask=m[:, None], other=0.0)
    b_b = tl.load(beta + rows * HV + i_hv, mask=m, other=0.0).to(tl.float32)
    b_bg = b_b
    if USE_G:
        b_gam, _ = gate_cumsum(g, rows, m, HV, i_hv)
        b_bg = b_b * tl.exp(b_gam)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mk = m[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0).to(tl.float32)
        b_w = tl.dot(b_A, (b_k * b_bg[:, None]).to(DT), input_precision=PREC)
        tl.store(W + (rows[:, None] * HV + i_hv) * K + o_k[None, :], b_w.to(DT), mask=mk)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mv = m[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mv, other=0.0).to(tl.float32)
        b_u = tl.dot(b_A, (b_v * b_b[:, None]).to(DT), input_precision=PREC)
        tl.store(U + (rows[:, None] * HV + i_hv) * V + o_v[None, :], b_u.to(DT), mask=mv)
