"""Forward kernels of the chunkwise Kimi Delta Attention (the math of :mod:`gdn.ops.kda.chunk`).

Per chunk of BT = 64 tokens and value head, with γ the in-chunk cumulative log decay per key
channel ([BT, K], γ ≤ 0, non-increasing down the chunk), Γ = exp γ, γ_C its last valid row and S
the state entering the chunk::

    A_ij = β_i Σ_c k_ic k_jc exp(γ_ic − γ_jc)  (j < i)          kkt     (with the solve)
    P_ij =     Σ_c q_ic k_jc exp(γ_ic − γ_jc)  (j ≤ i)          kkt
    T = (I + A)⁻¹;  W = T diag(β) (K ⊙ Γ),  U = T diag(β) V     kkt, wu
    δ = U − W S;  S ← diag(exp γ_C) S + (K ⊙ exp(γ_C − γ))ᵀ δ   state pass (sequential)
    O = scale · (P δ + (Q ⊙ Γ) S)                                output

The pairwise decay exp(γ_i − γ_j) is per channel, so A and P are no masked Q Kᵀ: they are built
from 16-row sub-blocks. For a block of rows I after a block of columns J the factor splits at r,
the first row of I: exp(γ_i − γ_r) · exp(γ_r − γ_j), both exponents ≤ 0 (so nothing overflows
however strongly a channel decays), and the block is one dot of the two rescaled tiles. A
diagonal block is the same dot through its own first row, whose column factor exp(γ_r − γ_j) ≥ 1
stays below e^SPAN while no channel decays by more than ``SPAN`` nats across the block; where one
does, that block is recomputed from pairwise exponents, exp(γ_i − γ_j) masked to j ≤ i before the
exp, as a [16, 16, BK] product summed over channels (exact at any decay). Rows past a
sequence's end are masked to −∞ in the exponent and the reference row is clamped to the last
valid row, so no 0 · ∞ arises.

Intermediates (T, P, W, U, δ, scale · Q ⊙ Γ, K ⊙ exp(γ_C − γ)) are stored in the input dtype; γ, the
per-chunk states (``STATE_DTYPE``), the running and the final states are fp32. Everything works on
the packed layout of :mod:`gdn.ops.triton.common` with K and V already padded to powers of two (≥ ``MIN_DIM``,
32) by the caller.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...triton.common import (BT, INTERPRET, Chunks, chunk_bounds, dot_precision, fill_empty, has_tma, load16,
                              sm_count, solve_blocks, store16, store_blocks, tl_dtype)
from ...triton.launch import launch as triton_launch
from ...tuning import KDA, for_dtype

#: dtype of the per-chunk states h and state gradients dh: fp32 for every input dtype. Stored in
#: bf16/fp16 they cost the per-channel dg ~2× the error that bf16 inputs cost anyway (measured with
#: fp16 under the interpreter: dg 6.0e-4 vs 1.6e-4 for the fp32 chunk form on the same inputs),
#: because dγ sums S ⊙ dS' and other state terms that largely cancel in the reverse cumsum.
STATE_DTYPE = torch.float32

#: Largest decay (nats, per key channel) across a 16-row block for which its diagonal pairs are
#: formed through the block's first row: the column factor exp(γ_r − γ_j) is then at most e^60 ≈
#: 1e26, far inside the range of fp32 and bf16 (e^88), so the dot cannot overflow. A block with a
#: stronger decay in some channel takes exact pairwise exponents instead (kkt, intra_bwd).
SPAN = 60.0
#: The same bound where kkt's dot operands are fp16 (largest finite value 65504 ≈ e^11.1): e^10.
SPAN_FP16 = 10.0


def entry(name: str, io: torch.dtype) -> dict:
    """Kernel ``name``'s entry of the KDA table for inputs of dtype ``io`` (its ``fp32`` or ``fp16``
    overrides applied: gdn.ops.tuning.for_dtype)."""
    return for_dtype(KDA[name], io)


def launch(kernel, grid, *args, name: str, io: torch.dtype, **meta):
    """:func:`gdn.ops.triton.launch.launch` with the KDA table's entry for ``io`` inputs."""
    return triton_launch(kernel, grid, *args, name=name, config=KDA, io=io, **meta)


def ktile(name: str, K: int, io: torch.dtype) -> int:
    """The K tile of kernel ``name`` for a padded K (a power of two ≥ 32)."""
    return min(entry(name, io)["BK"], K)


def vtile(name: str, K: int, V: int, io: torch.dtype) -> int:
    """The V tile of kernel ``name`` (sequential passes: ``SV // K`` values, at least 16)."""
    c = entry(name, io)
    return min(V, max(16, c["SV"] // K)) if "SV" in c else min(V, c["BV"])


def state_vtile(name: str, K: int, V: int, programs: int, device, io: torch.dtype) -> int:
    """V tile of a sequential pass with ``programs`` (sequence, value head) pairs: :func:`vtile`,
    halved (down to the entry's ``BV_min``) while twice the programs still run in one wave at the
    entry's ``per_sm`` programs per multiprocessor. Each program walks every chunk of its sequence:
    idle multiprocessors are lost for the whole pass, and so is a second wave."""
    c = entry(name, io)
    BV, slots = vtile(name, K, V, io), c.get("per_sm", 1) * sm_count(device)
    while BV > c["BV_min"] and 2 * programs * (V // BV) <= slots:
        BV //= 2
    return BV


# ----------------------------------------------------------------------------------------------
# Sub-block helpers (16 rows; a, b, γ are fp32 [16, BK] tiles of one K tile)
# ----------------------------------------------------------------------------------------------

@triton.jit
def chunk_rows(cu, chunk_idx, i_t):
    """(sequence n, first token t0 of chunk i_t (int64), its rows on the sequence nv ≤ 64 (int32)).
    Kernels advance their base pointers to row t0 once (an int64 scalar) and address a chunk's rows
    with int32 in-chunk offsets: int64 offset tiles would take twice the address registers."""
    i_n, t0, eos = chunk_bounds(cu, chunk_idx, i_t, 64)
    return i_n, t0, tl.minimum(eos - t0, 64).to(tl.int32)


@triton.jit
def load_rows(x, rows, m, stride_row, head, o_k, K: tl.constexpr):
    """x[rows, head, o_k] as fp32 ([len(rows), BK]); rows outside the sequence read 0. ``rows``
    are int32 offsets from ``x``, advanced to the chunk's (or the block's) first row."""
    return tl.load(x + (rows[:, None] * stride_row + head) * K + o_k[None, :], mask=m[:, None], other=0.0).to(
        tl.float32)


@triton.jit
def ref_row(G, r, nv, HV, i_hv, o_k, K: tl.constexpr):
    """γ [BK] at the reference row r clamped to the sequence's last row nv − 1 (in-chunk rows;
    every valid row of an earlier block is ≤ it, every valid row of its own block ≥ it)."""
    rr = tl.minimum(r, nv - 1)
    return tl.load(G + (rr * HV + i_hv) * K + o_k)


@triton.jit
def after_ref(gam, gref, m):
    """exp(γ_i − γ_r) for the rows of a block at or after its reference row r (0 off the sequence)."""
    return tl.exp(tl.where(m[:, None], gam - gref[None, :], float("-inf")))


@triton.jit
def before_ref(gam, gref):
    """exp(γ_r − γ_j) for the rows of an earlier block (≤ 1; rows off the sequence carry zeros)."""
    return tl.exp(gref[None, :] - gam)


@triton.jit
def diag_exponent(gam, m):
    """[16, 16, BK]: exp(γ_ic − γ_jc) for j ≤ i inside one block (rows i on the sequence), else 0."""
    o = tl.arange(0, 16)
    keep = (o[:, None] >= o[None, :]) & m[:, None]
    return tl.exp(tl.where(keep[:, :, None], gam[:, None, :] - gam[None, :, :], float("-inf")))


@triton.jit
def diag_pairs(a, b, e3):
    """[16, 16]: Σ_c a_ic b_jc e3_ijc (e3 from :func:`diag_exponent`)."""
    return tl.sum(a[:, None, :] * b[None, :, :] * e3, axis=2)


@triton.jit
def strict(X):
    """X with its diagonal and upper triangle zeroed (16 × 16)."""
    o = tl.arange(0, 16)
    return tl.where(o[:, None] > o[None, :], X, 0.0)


@triton.jit
def _mm(a, b, DT: tl.constexpr, PREC: tl.constexpr):
    """a @ bᵀ of two fp32 tiles, operands in DT, fp32 accumulation."""
    return tl.dot(a.to(DT), tl.trans(b.to(DT)), input_precision=PREC)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def gamma_kernel(g, G, cu, chunk_idx, HV, K: tl.constexpr, BK: tl.constexpr):
    """G[t, hv, :] = in-chunk cumulative sum of g (fp32), per key channel."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_n, t0, eos = chunk_bounds(cu, chunk_idx, i_t, 64)
    rows = t0 + tl.arange(0, 64)
    m = rows < eos
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p = (rows[:, None] * HV + i_hv) * K + o_k[None, :]
        b = tl.load(g + p, mask=m[:, None], other=0.0)
        tl.store(G + p, tl.cumsum(b, axis=0), mask=m[:, None])


@triton.jit
def _kkt_diag(q, k, G, nv, I, i_h, i_hv, H, HV, K: tl.constexpr, BK: tl.constexpr):
    """(A_II without β, P_II) [16, 16] of diagonal block I from pairwise exponents, one [16, 16, BK]
    exponent tensor per K tile for both: exact for any decay, and the kernel's slow path (taken
    only where a channel decays by more than ``SPAN`` across the block)."""
    o = tl.arange(0, 16)
    r_i = I * 16 + o
    m_i = r_i < nv
    a = tl.zeros([16, 16], dtype=tl.float32)
    p = tl.zeros([16, 16], dtype=tl.float32)
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = load_rows(k, r_i, m_i, H, i_h, o_k, K)
        e3 = diag_exponent(load_rows(G, r_i, m_i, HV, i_hv, o_k, K), m_i)
        a += diag_pairs(b_k, b_k, e3)
        p += diag_pairs(load_rows(q, r_i, m_i, H, i_h, o_k, K), b_k, e3)
    return a, p


@triton.jit
def _row_beta(beta, nv, I, HV, i_hv):
    """β of row block I as a [16, 1] column (0 off the sequence)."""
    r = I * 16 + tl.arange(0, 16)
    return tl.load(beta + r * HV + i_hv, mask=r < nv, other=0.0)[:, None]


@triton.jit
def block_span(gam, gref, m):
    """[BK]: per channel, the decay from the block's reference row to its last valid row (≥ 0)."""
    return tl.max(tl.where(m[:, None], gref[None, :] - gam, 0.0), axis=0)


@triton.jit
def lower(X):
    """X with its upper triangle zeroed (16 × 16, diagonal kept)."""
    o = tl.arange(0, 16)
    return tl.where(o[:, None] >= o[None, :], X, 0.0)


@triton.jit
def _kkt_rows(b_A, b_P, kl, ql, b_k, b_g, G, I, nv, blk, HV, i_hv, o_k, K: tl.constexpr, PREC: tl.constexpr,
              DT: tl.constexpr, SPAN: tl.constexpr):
    """Row block I's share of one K tile: its rows of kl and ql times the columns j of blocks ≤ I,
    K ⊙ exp(min(γ_rI − γ_j, SPAN)), added into b_A and b_P."""
    gr = ref_row(G, I * 16, nv, HV, i_hv, o_k, K)
    # rows past block I are zeroed, not only discarded afterwards: their factor can exceed
    # fp16's range, and 0 · inf in the product would spoil the other row blocks' sums
    c = tl.where((blk <= I)[:, None], b_k * tl.exp(tl.minimum(gr[None, :] - b_g, SPAN)), 0.0)
    sel = (blk == I)[:, None]
    b_A += _mm(tl.where(sel, kl, 0.0), c, DT, PREC)
    b_P += _mm(tl.where(sel, ql, 0.0), c, DT, PREC)
    return b_A, b_P


@triton.jit
def kkt_kernel(q, k, G, beta, P, A, cu, chunk_idx, H, HV, K: tl.constexpr, BK: tl.constexpr,
               BKD: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, SPAN: tl.constexpr,
               ROW_LOOP: tl.constexpr = False):
    """A (fp32, β folded in, strictly lower) and P (both [T, HV, 64], rows of each chunk) from
    whole-chunk products, for :func:`solve_kernel` to invert A: per K tile, the rows scaled once
    through their own block's reference row, X ⊙ exp(γ_i − γ_r(i)) (≤ 1), and for each row block I one [64, BK] × [BK, 64] product of those rows of I with
    K ⊙ exp(min(γ_rI − γ_j, SPAN)) (≤ 1 for j before I, capped on the diagonal, zero past it).
    A = diag(β) (strict lower part) is stored, then a diagonal block where a channel decays by
    more than SPAN across it is rewritten there and in P from pairwise exponents. ``ROW_LOOP``: the
    row blocks in a run-time loop (fewer live tiles: fp32 inputs, whose 3-pass operands are two
    tiles each) instead of unrolled."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, t0, nv = chunk_rows(cu, chunk_idx, i_t)
    q += t0 * H * K
    k += t0 * H * K
    G += t0 * HV * K
    beta += t0 * HV
    P += t0 * HV * 64
    A += t0 * HV * 64
    o_t = tl.arange(0, 64)
    m = o_t < nv
    blk = o_t // 16
    ref = tl.minimum(blk * 16, nv - 1)
    b_A = tl.zeros([64, 64], dtype=tl.float32)
    b_P = tl.zeros([64, 64], dtype=tl.float32)
    span = tl.zeros([64], dtype=tl.float32)
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = load_rows(k, o_t, m, H, i_h, o_k, K)
        b_g = load_rows(G, o_t, m, HV, i_hv, o_k, K)
        b_d = tl.where(m[:, None], tl.load(G + (ref[:, None] * HV + i_hv) * K + o_k[None, :]) - b_g, 0.0)
        span = tl.maximum(span, tl.max(b_d, axis=1))
        b_e = tl.where(m[:, None], tl.exp(-b_d), 0.0)
        kl = b_k * b_e
        ql = load_rows(q, o_t, m, H, i_h, o_k, K) * b_e
        if ROW_LOOP:
            for I in range(4):
                b_A, b_P = _kkt_rows(b_A, b_P, kl, ql, b_k, b_g, G, I, nv, blk, HV, i_hv, o_k, K, PREC, DT, SPAN)
        else:
            for I in tl.static_range(4):
                b_A, b_P = _kkt_rows(b_A, b_P, kl, ql, b_k, b_g, G, I, nv, blk, HV, i_hv, o_k, K, PREC, DT, SPAN)
    b_b = tl.load(beta + o_t * HV + i_hv, mask=m, other=0.0)
    p_a = (o_t[:, None] * HV + i_hv) * 64 + o_t[None, :]
    tl.store(A + p_a, tl.where(o_t[:, None] > o_t[None, :], b_A, 0.0) * b_b[:, None], mask=m[:, None])
    tl.store(P + p_a, tl.where(o_t[:, None] >= o_t[None, :], b_P, 0.0).to(P.dtype.element_ty), mask=m[:, None])
    o = tl.arange(0, 16)
    # the slow path in a run-time loop: unrolled, it is most of the kernel's compile time
    for I in range(4):
        if tl.max(tl.where((blk == I) & m, span, 0.0), axis=0) > SPAN:
            ad, pd = _kkt_diag(q, k, G, nv, I, i_h, i_hv, H, HV, K, BKD)
            r_i = I * 16 + o
            store16(A, strict(ad) * _row_beta(beta, nv, I, HV, i_hv), r_i, r_i < nv, HV, i_hv, I * 16)
            store16(P, lower(pd), r_i, r_i < nv, HV, i_hv, I * 16)


@triton.jit
def solve_kernel(A, Ai, cu, chunk_idx, HV):
    """Ai = (I + A)⁻¹ for each chunk from kkt's A ([T, HV, 64] fp32, strictly lower): the block solve
    (common.solve_blocks) in fp32. Its own kernel rather than kkt's tail: the two compile in
    parallel on a first call (together, kkt was the longest compile of the chunk op by 2×)."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_n, t0, nv = chunk_rows(cu, chunk_idx, i_t)
    A += t0 * HV * 64
    Ai += t0 * HV * 64
    r0 = tl.arange(0, 16)
    r1 = r0 + 16
    r2 = r0 + 32
    r3 = r0 + 48
    m0, m1, m2, m3 = r0 < nv, r1 < nv, r2 < nv, r3 < nv
    X00, X10, X11, X20, X21, X22, X30, X31, X32, X33 = solve_blocks(
        load16(A, r0, m0, HV, i_hv, 0), load16(A, r1, m1, HV, i_hv, 0), load16(A, r1, m1, HV, i_hv, 16),
        load16(A, r2, m2, HV, i_hv, 0), load16(A, r2, m2, HV, i_hv, 16), load16(A, r2, m2, HV, i_hv, 32),
        load16(A, r3, m3, HV, i_hv, 0), load16(A, r3, m3, HV, i_hv, 16), load16(A, r3, m3, HV, i_hv, 32),
        load16(A, r3, m3, HV, i_hv, 48), "ieee")
    store_blocks(Ai, X00, X10, X11, X20, X21, X22, X30, X31, X32, X33, r0, r1, r2, r3, m0, m1, m2, m3, HV, i_hv)


@triton.jit
def wu_kernel(q, k, v, G, beta, Ai, W, U, QG, KT, cu, chunk_idx, scale, H, HV, K: tl.constexpr, V: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """W = T diag(β) (K ⊙ Γ) and U = T diag(β) V for one chunk and value head, and the decayed
    operands of the state passes and the output, QG = scale · Q ⊙ Γ and KT = K ⊙ exp(γ_C − γ) (all
    in DT; the state passes then read one [64, K] tile per chunk each and take no exponential, and
    their dots accumulate in place: no factor is left to apply to a dot's result)."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, t0, nv = chunk_rows(cu, chunk_idx, i_t)
    q += t0 * H * K
    k += t0 * H * K
    v += t0 * HV * V
    U += t0 * HV * V
    G += t0 * HV * K
    W += t0 * HV * K
    QG += t0 * HV * K
    KT += t0 * HV * K
    beta += t0 * HV
    Ai += t0 * HV * 64
    rows = tl.arange(0, 64)
    m = rows < nv
    b_A = tl.load(Ai + (rows[:, None] * HV + i_hv) * 64 + rows[None, :], mask=m[:, None], other=0.0)
    b_b = tl.load(beta + rows * HV + i_hv, mask=m, other=0.0)
    last = nv - 1
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = (rows[:, None] * HV + i_hv) * K + o_k[None, :]
        b_k = load_rows(k, rows, m, H, i_h, o_k, K)
        b_g = load_rows(G, rows, m, HV, i_hv, o_k, K)
        b_gc = tl.load(G + (last * HV + i_hv) * K + o_k)
        b_e = tl.exp(b_g)
        b_w = tl.dot(b_A, (b_k * b_e * b_b[:, None]).to(DT), input_precision=PREC)
        tl.store(W + p_k, b_w.to(DT), mask=m[:, None])
        tl.store(KT + p_k, (b_k * tl.exp(b_gc[None, :] - b_g)).to(DT), mask=m[:, None])
        tl.store(QG + p_k, (load_rows(q, rows, m, H, i_h, o_k, K) * (scale * b_e)).to(DT), mask=m[:, None])
    for i_v in range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_v = load_rows(v, rows, m, HV, i_hv, o_v, V)
        b_u = tl.dot(b_A, (b_v * b_b[:, None]).to(DT), input_precision=PREC)
        tl.store(U + (rows[:, None] * HV + i_hv) * V + o_v[None, :], b_u.to(DT), mask=m[:, None])


@triton.jit
def _state_fwd_step(i_c, b_s, KT, G, W, U, h, VN, bos, eos, c0, i_hv, o_t, o_k, o_v, HV,
                    K: tl.constexpr, V: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Chunk i_c of the forward state pass, through pointers: δ = U − W S into VN, return the next S."""
    cs = bos + i_c * 64
    rows = cs + o_t
    m = rows < eos
    b_w = tl.load(W + (rows[:, None] * HV + i_hv) * K + o_k[None, :], mask=m[:, None], other=0.0)
    b_d = tl.dot(b_w, (-b_s).to(DT), acc=load_rows(U, rows, m, HV, i_hv, o_v, V), input_precision=PREC)
    tl.store(VN + (rows[:, None] * HV + i_hv) * V + o_v[None, :], b_d.to(DT), mask=m[:, None])
    b_kt = tl.load(KT + (rows[:, None] * HV + i_hv) * K + o_k[None, :], mask=m[:, None], other=0.0)
    last = tl.minimum(eos, cs + 64) - 1
    b_gc = tl.load(G + (last * HV + i_hv) * K + o_k, mask=(cs < eos) & (o_k < K), other=0.0)
    return tl.dot(tl.trans(b_kt), b_d.to(DT), acc=b_s * tl.exp(b_gc)[:, None], input_precision=PREC)


@triton.jit
def _state_fwd_step_tma(i_c, b_s, KT, G, W, U, h, VN, bos, eos, c0, i_hv, i_v, o_t, o_k, o_v, HV,
                        K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """:func:`_state_fwd_step` with W, KT and U read through tensor descriptors (bulk copies: no
    address registers, and none staging the dot operands), δ stored through pointers (as S is,
    :func:`_state_fwd_any`: stores that nothing waits on; a store through a descriptor goes out of shared memory, which the next
    step's S may not overwrite until it has). W, KT and U are read in whole blocks of 64 rows: the
    rows of a later sequence (finite, from wu) get δ = 0, so they add nothing to the state."""
    cs = bos + i_c * 64
    nv = tl.minimum(eos - cs, 64).to(tl.int32)
    m = o_t < nv
    b_w = W.load([cs.to(tl.int32), i_hv * K])
    b_d = tl.dot(b_w, (-b_s).to(DT), acc=U.load([cs.to(tl.int32), i_hv * V + i_v * BV]).to(tl.float32),
                 input_precision=PREC)
    b_d = tl.where(m[:, None], b_d, 0.0)
    tl.store(VN + cs * HV * V + (o_t[:, None] * HV + i_hv) * V + o_v[None, :], b_d.to(DT), mask=m[:, None])
    b_kt = KT.load([cs.to(tl.int32), i_hv * K])
    b_gc = tl.load(G + ((cs + nv - 1) * HV + i_hv) * K + o_k)
    return tl.dot(tl.trans(b_kt), b_d.to(DT), acc=b_s * tl.exp(b_gc)[:, None], input_precision=PREC)


@triton.jit
def _state_fwd_any(i_c, b_s, KT, G, W, U, h, VN, ht, bos, eos, c0, nc, i_n, i_hv, i_v, o_t, o_k, o_v, HV,
                   K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, STORE_FINAL: tl.constexpr, PREC: tl.constexpr,
                   DT: tl.constexpr, TMA: tl.constexpr):
    """Step i_c of the forward state pass in the form ``TMA`` names: S entering the chunk into h, δ,
    the next S; with ``STORE_FINAL`` the last step (i_c = nc − 1) stores the state it returns as the
    final state, its addresses formed here rather than held across the loop (the launch fills the
    final state of a sequence without chunks, which has no step: common.fill_empty)."""
    tl.store(h + ((c0 + i_c) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :], b_s.to(h.dtype.element_ty))
    if TMA:
        b_s = _state_fwd_step_tma(i_c, b_s, KT, G, W, U, h, VN, bos, eos, c0, i_hv, i_v, o_t, o_k, o_v, HV, K, V, BV,
                                  PREC, DT)
    else:
        b_s = _state_fwd_step(i_c, b_s, KT, G, W, U, h, VN, bos, eos, c0, i_hv, o_t, o_k, o_v, HV, K, V, PREC, DT)
    if STORE_FINAL:
        tl.store(ht + (i_n * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :], b_s,
                 mask=(i_c == nc - 1) & (o_k < K)[:, None])
    return b_s


@triton.jit
def state_fwd_kernel(KT, G, W, U, h0, h, VN, ht, cu, chunk_off, HV, K: tl.constexpr,
                     V: tl.constexpr, BV: tl.constexpr, USE_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
                     PREC: tl.constexpr, DT: tl.constexpr, WHILE: tl.constexpr, TMA: tl.constexpr = False):
    """Sequential pass over one sequence's chunks for one value head and V tile: h [NT, HV, K, V]
    (state entering each chunk), VN = δ [T, HV, V], final state ht [N, HV, K, V] (fp32; stored by
    the last step, so not for a sequence without chunks, whose final state the launch copies from
    h0). Runs the sequence's own chunk count, so in a packed batch a short sequence's programs end
    early.
    ``TMA``: W, KT and U are tensor descriptors of their [T, HV · K] and [T, HV · V] views with
    [64, K] and [64, BV] blocks (the copies take no address registers, and none for staging the
    dot operands in shared memory; :func:`_state_fwd_step_tma`); h, VN and ht are stored through
    pointers in either form."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_off + i_n).to(tl.int64)
    o_t = tl.arange(0, 64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    b_s = tl.zeros([K, BV], dtype=tl.float32)
    if USE_INIT:
        b_s = tl.load(h0 + (i_n * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]).to(tl.float32)
    nc = tl.cdiv(eos - bos, 64)
    if WHILE:
        i_c = 0
        while i_c < nc:
            b_s = _state_fwd_any(i_c, b_s, KT, G, W, U, h, VN, ht, bos, eos, c0, nc, i_n, i_hv, i_v, o_t, o_k, o_v,
                                 HV, K, V, BV, STORE_FINAL, PREC, DT, TMA)
            i_c += 1
    else:
        for i_c in range(0, nc):
            b_s = _state_fwd_any(i_c, b_s, KT, G, W, U, h, VN, ht, bos, eos, c0, nc, i_n, i_hv, i_v, o_t, o_k, o_v,
                                 HV, K, V, BV, STORE_FINAL, PREC, DT, TMA)


@triton.jit
def output_kernel(QG, P, h, VN, o, cu, chunk_idx, scale, HV, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """O = scale · P δ + QG S (QG = scale · Q ⊙ Γ) for one chunk, value head and V tile."""
    i_v, i_t, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, t0, nv = chunk_rows(cu, chunk_idx, i_t)
    QG += t0 * HV * K
    P += t0 * HV * 64
    VN += t0 * HV * V
    o += t0 * HV * V
    h += (i_t.to(tl.int64) * HV + i_hv) * K * V
    o_t = tl.arange(0, 64)
    rows = o_t
    m = rows < nv
    o_v = i_v * BV + tl.arange(0, BV)
    b_o = tl.zeros([64, BV], dtype=tl.float32)
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_q = tl.load(QG + (rows[:, None] * HV + i_hv) * K + o_k[None, :], mask=m[:, None], other=0.0)
        b_s = tl.load(h + o_k[:, None] * V + o_v[None, :])
        b_o += tl.dot(b_q, b_s.to(DT), input_precision=PREC)
    b_p = tl.load(P + (rows[:, None] * HV + i_hv) * 64 + o_t[None, :], mask=m[:, None], other=0.0)
    b_d = tl.load(VN + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=m[:, None], other=0.0)
    b_o += scale * tl.dot(b_p, b_d, input_precision=PREC)
    tl.store(o + (rows[:, None] * HV + i_hv) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m[:, None])


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

def gamma(g: torch.Tensor, ch: Chunks) -> torch.Tensor:
    """The in-chunk cumulative log decay of g [T, HV, K] (fp32, K padded)."""
    T, HV, K = g.shape
    G = torch.empty_like(g)
    launch(gamma_kernel, (ch.NT, HV), g, G, ch.cu, ch.chunk_idx, HV, K=K, BK=ktile("gamma", K, g.dtype), name="gamma",
           io=g.dtype)
    return G


def state_tiles(W: torch.Tensor, KT: torch.Tensor, U: torch.Tensor, BV: int) -> tuple:
    """(TMA, (W, KT, U)) as the forward state pass reads them: with ``KDA["state_fwd"]["TMA"]``,
    where the card has the tensor-memory accelerator (and under the interpreter, which runs
    descriptors too) and every tensor is contiguous and 16-byte aligned with coordinates inside
    int32, (True, tensor descriptors: W and KT of their [T, HV · K] views in [64, K] blocks, U of
    its [T, HV · V] view in [64, BV] blocks); else (False, the tensors themselves)."""
    T, K, V = W.shape[0], W.shape[2], U.shape[2]
    xs = (W, KT, U)
    ok = (KDA["state_fwd"]["TMA"] and has_tma(W) and all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in xs)
          and all(x.numel() // x.shape[-1] < 2 ** 31 for x in xs) and (V * U.element_size()) % 16 == 0)
    if not ok:
        return False, xs
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

    return True, (TensorDescriptor.from_tensor(W.view(T, -1), block_shape=[BT, K]),
                  TensorDescriptor.from_tensor(KT.view(T, -1), block_shape=[BT, K]),
                  TensorDescriptor.from_tensor(U.view(T, -1), block_shape=[BT, BV]))


@dataclass
class Intermediates:
    """What the forward's first stages leave for the output and the backward (packed layout).
    Ai, P: [T, HV, 64]; W, QG, KT: [T, HV, K]; VN = δ: [T, HV, V], all in the inputs' dtype;
    h: [NT, HV, K, V] (``STATE_DTYPE``); ht: [N, HV, K, V] fp32 or None."""

    Ai: torch.Tensor
    P: torch.Tensor
    W: torch.Tensor
    QG: torch.Tensor
    KT: torch.Tensor
    h: torch.Tensor
    VN: torch.Tensor
    ht: torch.Tensor | None


def forward_intermediates(q, k, v, G, beta, h0, ch: Chunks, want_final: bool, scale: float,
                          kkt: tuple | None = None) -> Intermediates:
    """The forward up to the output. q, k: [T, H, K]; v: [T, HV, V] (one dtype, K and V powers of
    two ≥ 32); G: [T, HV, K] fp32 (:func:`gamma`); beta: [T, HV] fp32; h0: [N, HV, K, V] fp32 or None.
    ``kkt``: (Ai, P) of an earlier call on the same inputs (the backward's recompute), else made here."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    prec, DT, io, dev = dot_precision(v.dtype), tl_dtype(v.dtype), v.dtype, v.device
    if kkt is None:
        Ai = torch.empty(T, HV, BT, device=dev, dtype=io)
        P = torch.empty(T, HV, BT, device=dev, dtype=io)
        A = torch.empty(T, HV, BT, device=dev, dtype=torch.float32)
        launch(kkt_kernel, (ch.NT, HV), q, k, G, beta, P, A, ch.cu, ch.chunk_idx, H, HV, K=K,
               BK=ktile("kkt", K, io), BKD=min(entry("kkt", io)["BKD"], K), PREC=prec, DT=DT,
               SPAN=SPAN_FP16 if io == torch.float16 else SPAN, ROW_LOOP=entry("kkt", io)["ROW_LOOP"], name="kkt",
               io=io)
        launch(solve_kernel, (ch.NT, HV), A, Ai, ch.cu, ch.chunk_idx, HV, name="solve", io=io)
        del A
    else:
        Ai, P = kkt
    W, QG, KT = (torch.empty(T, HV, K, device=dev, dtype=io) for _ in range(3))
    U = torch.empty(T, HV, V, device=dev, dtype=io)
    launch(wu_kernel, (ch.NT, HV), q, k, v, G, beta, Ai, W, U, QG, KT, ch.cu, ch.chunk_idx, scale, H, HV, K=K, V=V,
           BK=ktile("wu", K, io), BV=vtile("wu", K, V, io), PREC=prec, DT=DT, name="wu", io=io)
    h = torch.empty(ch.NT, HV, K, V, device=dev, dtype=STATE_DTYPE)
    VN = torch.empty(T, HV, V, device=dev, dtype=io)
    ht = torch.empty(ch.N, HV, K, V, device=dev, dtype=torch.float32) if want_final else None
    SV = state_vtile("state_fwd", K, V, ch.N * HV, dev, io)
    tma, (Ws, KTs, Us) = state_tiles(W, KT, U, SV)
    launch(state_fwd_kernel, (V // SV, ch.N * HV), KTs, G, Ws, Us, h0 if h0 is not None else v, h, VN,
           ht if ht is not None else v, ch.cu, ch.chunk_off, HV, K=K, V=V, BV=SV,
           USE_INIT=h0 is not None, STORE_FINAL=want_final, PREC=prec, DT=DT, WHILE=INTERPRET, TMA=tma,
           name="state_fwd", io=io)
    fill_empty(ht, h0, ch)
    return Intermediates(Ai, P, W, QG, KT, h, VN, ht)


def output(fw: Intermediates, ch: Chunks, scale: float, out_dtype) -> torch.Tensor:
    """o [T, HV, V] in ``out_dtype`` from the forward's intermediates (P, QG, h, δ)."""
    T, HV, K = fw.QG.shape
    V = fw.VN.shape[2]
    o = torch.empty(T, HV, V, device=fw.VN.device, dtype=out_dtype)
    io = fw.VN.dtype
    BV = vtile("output", K, V, io)
    launch(output_kernel, (V // BV, ch.NT, HV), fw.QG, fw.P, fw.h, fw.VN, o, ch.cu, ch.chunk_idx, scale, HV, K=K,
           V=V, BK=ktile("output", K, io), BV=BV, PREC=dot_precision(io), DT=tl_dtype(io), name="output", io=io)
    return o
