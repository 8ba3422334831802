"""Forward kernels of the chunkwise recurrence (the math of gdn/ops/delta/chunk.py).

Per chunk of BT = 64 tokens, with γ the in-chunk cumulative log decay, Γ = exp(γ),
D_ij = exp(γ_i − γ_j) (j ≤ i) and S the state entering the chunk::

    T = (I + tril(diag(β)(K Kᵀ ⊙ D), −1))⁻¹            kkt_solve   (delta members)
    W = T diag(βΓ) K,  U = T diag(β) V                  wu          (delta members)
    δ = U − W S  (δ = V without the delta term)         state pass  (sequential over chunks)
      = T X,  X = diag(β)(V − diag(Γ) K S)              state pass reading T and V instead
                                                        (``from_inverse``: no wu, no W, U)
    S ← Γ_C S + (diag(exp(γ_C − γ)) K)ᵀ δ               state pass
    O = scale · ((Q Kᵀ ⊙ D) δ + diag(Γ) Q S)             output

The gate (``USE_G``) and the delta term (``DELTA``) are compile-time switches, so the four
members share these kernels. Intermediates (T, W, U, δ, per-chunk states) are stored in the
input dtype (bf16/fp16 for half inputs, as FLA does; fp32 for fp32 inputs) and every dot takes
operands of that dtype with fp32 accumulation; the running state and the returned final state
are fp32.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...triton.common import (BT, INTERPRET, Chunks, chunk_bounds, chunk_cumsum, dot_precision, gate_cumsum, gate_load,
                              has_tma, launch, make_segments, pow2, sm_count, state_rows, tl_dtype, value_cols)
from ...tuning import DELTA, cdiv
from ...tuning import chunk_tiles as tiles
from .intra import kkt_solve_kernel, wu_kernel
from .split import bounds, chain, fill_empty, split_len, warm_split, warm_up


@triton.jit
def _block(x, row0, col0):
    """The block of tensor descriptor ``x`` (of a row-major [T, width] tensor) whose first row is
    ``row0`` and first column ``col0``: one bulk copy by the tensor-memory accelerator instead of a
    load per thread and element. It reads zeros past T but the rows of a later sequence as they
    are: the caller keeps those out of every result it stores."""
    return x.load([row0.to(tl.int32), col0.to(tl.int32)])  # (descriptor offsets are 32-bit)


@triton.jit
def _delta_from_inverse(b_k, b_sd, v, beta, Ai, b_gam, rows, m, o_t, o_u, mv, i_hv, HV, V: tl.constexpr,
                        BT: tl.constexpr, USE_G: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                        TMA: tl.constexpr = False, row0=0, v0=0):
    """δ = T X with X = diag(β)(V − diag(Γ) K S) for one chunk and value tile, fp32 [BT, BV]:
    U − W S without W and U, since W S = T diag(βΓ) K S. b_k: K [BT, K] in DT; b_sd: S in DT;
    b_gam: γ [BT] (unused without the gate); ``o_u``, ``mv`` as :func:`value_cols` gives them.

    Rounding (DT = the input dtype): K S is a DT × DT dot accumulated in fp32, X is formed in fp32
    and rounded to DT once, T (stored in DT by kkt_solve) times X accumulates in fp32. The stored
    path rounds W and U to DT, then forms U − W S in fp32: there the cancellation between U and
    W S happens after the two roundings; here V − Γ K S cancels in fp32 before the one rounding of
    X. Masked rows (past the sequence end) read V = β = 0 and T = 0: δ is 0 there."""
    b_ks = tl.dot(b_k, b_sd, input_precision=PREC)
    if USE_G:
        b_ks = b_ks * tl.exp(b_gam)[:, None]
    # (row0: the chunk's first row; v0: the value tile's first column, which never reaches past V)
    if TMA:
        b_v = _block(v, row0, i_hv * V + v0).to(tl.float32)
    else:
        b_v = tl.load(v + (rows[:, None] * HV + i_hv) * V + o_u[None, :], mask=mv, other=0.0).to(tl.float32)
    b_b = tl.load(beta + rows * HV + i_hv, mask=m, other=0.0).to(tl.float32)
    b_x = ((b_v - b_ks) * b_b[:, None]).to(DT)
    if TMA:
        b_a = _block(Ai, row0, i_hv * BT)
    else:
        b_a = tl.load(Ai + (rows[:, None] * HV + i_hv) * BT + o_t[None, :], mask=m[:, None], other=0.0)
    return tl.dot(b_a, b_x, input_precision=PREC)


@triton.jit
def _state_fwd_step(i_c, b_s, k, v, g, W, U, Ai, beta, h, VN, bos, eos, c0, i_hv, i_h, o_t, o_k, o_v, mkv, p_s,
                    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                    USE_G: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                    AUG: tl.constexpr, FROM_INV: tl.constexpr, TMA: tl.constexpr = False, v0=0, keep=True):
    """One chunk of the forward state pass: store S, compute δ, return the next S (``keep`` false:
    store nothing, a warm-up chunk of ``state_fwd_kernel``'s ``WARM`` form). With ``AUG`` the
    state's columns are [K transition columns | V value columns]: the first K read zero values and
    nothing is stored (see ``state_fwd_kernel``). ``FROM_INV`` (delta members only): δ from T and
    V (:func:`_delta_from_inverse`) instead of W and U. ``TMA`` (not with ``AUG``): k, v, W, U and
    Ai are tensor descriptors (:func:`_block`), δ is zeroed on the rows of a later sequence, and
    ``v0`` is the value tile's first column."""
    row0 = bos + i_c * BT
    rows = row0 + o_t
    b_sd = b_s.to(DT)
    if not AUG:
        tl.store(h + ((c0 + i_c) * HV + i_hv) * K * V + p_s, b_sd, mask=mkv & (bos + i_c * BT < eos) & keep)
    m = rows < eos
    mk = m[:, None] & (o_k < K)[None, :]
    o_u, mv = value_cols(o_v, m, K, V, AUG)
    if FROM_INV:  # K S enters δ, so K and γ are loaded first
        if TMA:
            b_k = _block(k, row0, i_h * K)
        else:
            b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
        b_gam = tl.zeros([BT], dtype=tl.float32)
        if USE_G:
            cs = bos + i_c * BT
            b_gam, b_gc = gate_load(g, rows, m, HV, i_hv, tl.minimum(eos, cs + BT) - 1, cs < eos)
        b_d = _delta_from_inverse(b_k, b_sd, v, beta, Ai, b_gam, rows, m, o_t, o_u, mv, i_hv, HV, V, BT, USE_G,
                                  PREC, DT, TMA, row0, v0)
        if not AUG:
            tl.store(VN + (rows[:, None] * HV + i_hv) * V + o_u[None, :], b_d.to(DT), mask=mv & keep)
    else:
        if DELTA:
            if TMA:
                b_w = _block(W, row0, i_hv * K)
                b_u = _block(U, row0, i_hv * V + v0).to(tl.float32)
            else:
                b_w = tl.load(W + (rows[:, None] * HV + i_hv) * K + o_k[None, :], mask=mk, other=0.0)
                b_u = tl.load(U + (rows[:, None] * HV + i_hv) * V + o_u[None, :], mask=mv, other=0.0).to(tl.float32)
            b_d = b_u - tl.dot(b_w, b_sd, input_precision=PREC)
            if not AUG:
                tl.store(VN + (rows[:, None] * HV + i_hv) * V + o_u[None, :], b_d.to(DT), mask=mv & keep)
        elif TMA:
            b_d = _block(v, row0, i_hv * V + v0).to(tl.float32)
        else:
            b_d = tl.load(v + (rows[:, None] * HV + i_hv) * V + o_u[None, :], mask=mv, other=0.0).to(tl.float32)
        if TMA:
            b_k = _block(k, row0, i_h * K)
        else:
            b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
        if USE_G:  # g holds the in-chunk cumulative decay γ here (chunk_cumsum)
            cs = bos + i_c * BT
            b_gam, b_gc = gate_load(g, rows, m, HV, i_hv, tl.minimum(eos, cs + BT) - 1, cs < eos)
    if TMA:  # the rows of a later sequence add nothing to the state
        b_d = tl.where(m[:, None], b_d, tl.zeros_like(b_d))
    if USE_G:
        # K̃ᵀδ with K̃ = diag(exp(γ_C − γ)) K: the row scale goes on δ ([BT, BV]), so K feeds the dot
        # as loaded (no conversion of the [BT, K] tile each step)
        b_d = b_d * tl.exp(b_gc - b_gam)[:, None]
        b_s = b_s * tl.exp(b_gc)
    return b_s + tl.dot(tl.trans(b_k), b_d.to(DT), input_precision=PREC)


@triton.jit
def state_fwd_kernel(k, v, g, W, U, Ai, beta, h0, h, VN, ht, cu, chunk_off, H, HV, seg_seq, seq_cu, seq_off, Bnd,
                     K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     USE_G: tl.constexpr, DELTA: tl.constexpr, USE_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
                     PREC: tl.constexpr, DT: tl.constexpr, WHILE: tl.constexpr, AUG: tl.constexpr = False,
                     FROM_INV: tl.constexpr = False, TMA: tl.constexpr = False, WARM: tl.constexpr = False,
                     LOG_EPS: tl.constexpr = -16.0):
    """Sequential pass over one sequence's chunks for one value head and one V tile.

    Stores the state entering each chunk in h [NT, HV, K, V] and, for delta members,
    δ = U − W S in VN [T, HV, V] (with ``FROM_INV``, δ = T diag(β)(V − diag(Γ) K S) from the
    in-chunk inverse Ai [T, HV, BT], v and beta; W and U are not read); the final state in
    ht [N, HV, K, V]. Each program runs its own
    sequence's chunk count of steps (a runtime bound: T is no compile-time key, and in a packed
    batch the programs of short sequences finish early instead of stepping through masked chunks);
    the rows past the end of a last, partial chunk are masked.

    ``AUG`` (the first phase of the split pass, :func:`forward_intermediates`): the "sequences" are
    segments, the state is K × (K + V) and starts as [I | 0], the first K columns see zero values,
    nothing per chunk is stored, and the final state [A | B] is written to ``ht`` [N, HV, K, K + V]:
    the segment maps an entering state S to A S + B.

    ``WARM`` (gated members; the warm-started split pass): the "sequences" are segments
    (``cu``, ``chunk_off``), of sequence ``seg_seq[s]`` whose tokens ``seq_cu`` bounds. A segment's
    program walks back over whole chunks before it, adding up their log norm bounds (Bnd [NT, HV],
    split.bounds; γ_C without the delta term: split.warm_up), until the sum falls to ``LOG_EPS``
    or the sequence starts; it runs those warm-up chunks from a zero
    state (from h0 at the sequence start) storing nothing, then its own chunks. The state it enters
    its segment with differs from the true one by at most e^LOG_EPS times the true state at its
    warm-up's start (the chunks' maps multiply, and so do their norms), exactly nothing when the
    walk reached the sequence start. The last segment of a sequence stores its final state.
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_off + i_n).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    NV: tl.constexpr = K + V if AUG else V
    mkv = (o_k < K)[:, None] & (o_v < NV)[None, :]
    p_s = (o_k[:, None] * V + o_v[None, :])
    nc = tl.cdiv(eos - bos, BT)
    i_init = i_n
    at_start = True
    last = True
    nw = 0
    if WARM:
        i_init, sbos, seos, nw = warm_up(Bnd, g, seg_seq, seq_cu, seq_off, i_n, bos, eos, i_hv, HV, BT, DELTA,
                                         LOG_EPS, False)
        last = eos == seos
        at_start = bos - nw * BT == sbos
        bos -= nw * BT
        c0 -= nw
        nc += nw
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if AUG:
        b_s = (o_k[:, None] == o_v[None, :]).to(tl.float32)
    elif USE_INIT:
        b_s = tl.load(h0 + (i_init * HV + i_hv).to(tl.int64) * K * V + p_s, mask=mkv & at_start, other=0.0).to(
            tl.float32)
    if WHILE:
        i_c = 0
        while i_c < nc:
            b_s = _state_fwd_step(i_c, b_s, k, v, g, W, U, Ai, beta, h, VN, bos, eos, c0, i_hv, i_h, o_t, o_k, o_v,
                                  mkv, p_s, H, HV, K, V, BT, USE_G, DELTA, PREC, DT, AUG, FROM_INV, TMA,
                                  i_v * BV, i_c >= nw)
            i_c += 1
    else:
        for i_c in range(0, nc):
            b_s = _state_fwd_step(i_c, b_s, k, v, g, W, U, Ai, beta, h, VN, bos, eos, c0, i_hv, i_h, o_t, o_k, o_v,
                                  mkv, p_s, H, HV, K, V, BT, USE_G, DELTA, PREC, DT, AUG, FROM_INV, TMA,
                                  i_v * BV, i_c >= nw)
    if STORE_FINAL:
        tl.store(ht + (i_init * HV + i_hv).to(tl.int64) * K * NV + o_k[:, None] * NV + o_v[None, :], b_s,
                 mask=mkv & last)


@triton.jit
def output_kernel(q, k, v, g, h, VN, o, cu, chunk_idx, scale, H, HV,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  USE_G: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """O = scale · ((Q Kᵀ ⊙ D) δ + diag(Γ) Q S) for one chunk, value head and V tile."""
    i_v, i_t, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_bounds(cu, chunk_idx, i_t, BT)
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    m = rows < eos
    o_v = i_v * BV + tl.arange(0, BV)
    mv = m[:, None] & (o_v < V)[None, :]
    b_p = tl.zeros([BT, BT], dtype=tl.float32)
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mk = m[:, None] & (o_k < K)[None, :]
        b_q = tl.load(q + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
        b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
        b_p += tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        b_s = tl.load(h + (i_t.to(tl.int64) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=(o_k < K)[:, None] & (o_v < V)[None, :], other=0.0)
        b_o += tl.dot(b_q, b_s, input_precision=PREC)
    if USE_G:
        b_gam, _ = gate_cumsum(g, rows, m, HV, i_hv)
        b_o = b_o * tl.exp(b_gam)[:, None]
        b_p = b_p * tl.exp(tl.where(o_t[:, None] >= o_t[None, :], b_gam[:, None] - b_gam[None, :], float("-inf")))
    else:
        b_p = tl.where(o_t[:, None] >= o_t[None, :], b_p, 0.0)
    if DELTA:
        b_d = tl.load(VN + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mv, other=0.0)
    else:
        b_d = tl.load(v + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mv, other=0.0)
    b_o = scale * (b_o + tl.dot(b_p.to(DT), b_d.to(DT), input_precision=PREC))
    tl.store(o + (rows[:, None] * HV + i_hv) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=mv)


@triton.jit
def _state_out_step(i_c, b_s, q, k, v, g, W, U, Ai, beta, PQ, o, bos, eos, scale, i_hv, i_h, o_t, o_k, o_v,
                    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                    USE_G: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                    FROM_INV: tl.constexpr, TMA: tl.constexpr = False, v0=0, PRE_P: tl.constexpr = False):
    """One chunk of the fused forward pass: its output rows from the entering state, then the next
    state. The same arithmetic as ``_state_fwd_step`` followed by ``output_kernel`` (S and δ rounded
    to DT where those kernels store them), without S or δ leaving the chip. ``FROM_INV`` (delta
    members only): δ from T and V (:func:`_delta_from_inverse`) instead of W and U. ``TMA``: q, k
    (and with ``FROM_INV`` v and Ai, with ``PRE_P`` PQ) are tensor descriptors (:func:`_block`); ``v0``
    is the value tile's first column. ``PRE_P``: the pair matrix Q Kᵀ ⊙ D is read from PQ
    [T, HV, BT] (kkt_solve's, in DT) instead of formed here."""
    row0 = bos + i_c * BT
    rows = row0 + o_t
    m = rows < eos
    mk = m[:, None] & (o_k < K)[None, :]
    mv = m[:, None] & (o_v < V)[None, :]
    b_sd = b_s.to(DT)
    if TMA:
        b_q = _block(q, row0, i_h * K)
        b_k = _block(k, row0, i_h * K)
    else:
        b_q = tl.load(q + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
        b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
    if FROM_INV:  # γ enters δ (Γ K S), so it is loaded first
        b_gam = tl.zeros([BT], dtype=tl.float32)
        if USE_G:
            cs = bos + i_c * BT
            b_gam, b_gc = gate_load(g, rows, m, HV, i_hv, tl.minimum(eos, cs + BT) - 1, cs < eos)
        b_d = _delta_from_inverse(b_k, b_sd, v, beta, Ai, b_gam, rows, m, o_t, o_v, mv, i_hv, HV, V, BT, USE_G,
                                  PREC, DT, TMA, row0, v0).to(DT)
    elif DELTA:
        b_w = tl.load(W + (rows[:, None] * HV + i_hv) * K + o_k[None, :], mask=mk, other=0.0)
        b_u = tl.load(U + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mv, other=0.0).to(tl.float32)
        b_d = (b_u - tl.dot(b_w, b_sd, input_precision=PREC)).to(DT)
    else:
        b_d = tl.load(v + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mv, other=0.0).to(DT)
    if TMA:
        # rows of a later sequence (read as they are) give δ rows that only they would see: δ is
        # zeroed there, so K̃ᵀ δ and P δ take nothing from them (K S, X and T X need no mask: β is 0
        # there and T is lower triangular), and their o rows are not stored
        b_d = tl.where(m[:, None], b_d, tl.zeros_like(b_d))
    b_o = tl.dot(b_q, b_sd, input_precision=PREC)
    if USE_G:  # g holds the in-chunk cumulative decay γ here (chunk_cumsum)
        if not FROM_INV:
            cs = bos + i_c * BT
            b_gam, b_gc = gate_load(g, rows, m, HV, i_hv, tl.minimum(eos, cs + BT) - 1, cs < eos)
        b_o = b_o * tl.exp(b_gam)[:, None]
    if PRE_P:
        if TMA:
            b_p = _block(PQ, row0, i_hv * BT)
        else:
            b_p = tl.load(PQ + (rows[:, None] * HV + i_hv) * BT + o_t[None, :], mask=m[:, None], other=0.0)
    else:
        b_p = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        if USE_G:
            b_p = b_p * tl.exp(tl.where(o_t[:, None] >= o_t[None, :], b_gam[:, None] - b_gam[None, :], float("-inf")))
        else:
            b_p = tl.where(o_t[:, None] >= o_t[None, :], b_p, 0.0)
        b_p = b_p.to(DT)
    b_o = scale * (b_o + tl.dot(b_p, b_d, input_precision=PREC))
    tl.store(o + (rows[:, None] * HV + i_hv) * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=mv)
    if USE_G:
        b_d = (b_d.to(tl.float32) * tl.exp(b_gc - b_gam)[:, None]).to(DT)
        b_s = b_s * tl.exp(b_gc)
    return b_s + tl.dot(tl.trans(b_k), b_d, input_precision=PREC)


@triton.jit
def state_out_kernel(q, k, v, g, W, U, Ai, beta, PQ, h0, o, ht, cu, scale, H, HV, seg_seq, seq_cu, seq_off,
                     Bnd, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     USE_G: tl.constexpr, DELTA: tl.constexpr, USE_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
                     PREC: tl.constexpr, DT: tl.constexpr, WHILE: tl.constexpr, FROM_INV: tl.constexpr = False,
                     TMA: tl.constexpr = False, PRE_P: tl.constexpr = False, WARM: tl.constexpr = False,
                     LOG_EPS: tl.constexpr = -16.0):
    """The forward's sequential pass with the output fused in, for one sequence, value head and V
    tile: per chunk, O = scale · (diag(Γ) Q S + (Q Kᵀ ⊙ D) δ) from the entering state S, then
    S ← Γ_C S + K̃ᵀ δ. Neither the per-chunk states nor δ are stored (the backward recomputes them);
    o [T, HV, V], the final state in ht [N, HV, K, V]. Runs the sequence's own chunk count of steps
    (as :func:`state_fwd_kernel`). δ = U − W S, or with ``FROM_INV`` T diag(β)(V − diag(Γ) K S)
    from the in-chunk inverse Ai [T, HV, BT], v and beta (W and U are not read). ``TMA``: q, k, v
    and Ai come as tensor descriptors of their [T, heads × width] views (:func:`_block`). ``PRE_P``:
    the pair matrix is read from PQ [T, HV, BT] (kkt_solve's) instead of formed per value tile.

    ``WARM`` (gated members): the "sequences" are segments of sequence ``seg_seq[s]`` (tokens
    bounded by ``seq_cu``, first chunks ``seq_off``), warm-started as in :func:`state_fwd_kernel`
    (the chunks' bounds in Bnd): the warm-up chunks before
    a segment update the state only (no output), then the segment's own chunks give their output."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mkv = (o_k < K)[:, None] & (o_v < V)[None, :]
    i_init = i_n
    at_start = True
    last = True
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if WARM:
        i_init, sbos, seos, nw = warm_up(Bnd, g, seg_seq, seq_cu, seq_off, i_n, bos, eos, i_hv, HV, BT, DELTA,
                                         LOG_EPS, False)
        last = eos == seos
        at_start = bos - nw * BT == sbos
    p_s = (i_init * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    if USE_INIT:
        b_s = tl.load(h0 + p_s, mask=mkv & at_start, other=0.0).to(tl.float32)
    if WARM:
        # the warm-up chunks, whole ones before the segment: the state step alone, nothing stored
        # (o stands in for the per-chunk stores _state_fwd_step makes only when ``keep``)
        wbos = bos - nw * BT
        i_w = 0
        while i_w < nw:
            b_s = _state_fwd_step(i_w, b_s, k, v, g, W, U, Ai, beta, o, o, wbos, bos, 0, i_hv, i_h, o_t, o_k, o_v,
                                  mkv, o_k[:, None] * V + o_v[None, :], H, HV, K, V, BT, USE_G, DELTA, PREC, DT,
                                  False, FROM_INV, TMA, i_v * BV, False)
            i_w += 1
    nc = tl.cdiv(eos - bos, BT)
    if WHILE:
        i_c = 0
        while i_c < nc:
            b_s = _state_out_step(i_c, b_s, q, k, v, g, W, U, Ai, beta, PQ, o, bos, eos, scale, i_hv, i_h, o_t, o_k,
                                  o_v, H, HV, K, V, BT, USE_G, DELTA, PREC, DT, FROM_INV, TMA, i_v * BV, PRE_P)
            i_c += 1
    else:
        for i_c in range(0, nc):
            b_s = _state_out_step(i_c, b_s, q, k, v, g, W, U, Ai, beta, PQ, o, bos, eos, scale, i_hv, i_h, o_t, o_k,
                                  o_v, H, HV, K, V, BT, USE_G, DELTA, PREC, DT, FROM_INV, TMA, i_v * BV, PRE_P)
    if STORE_FINAL:
        tl.store(ht + p_s, b_s, mask=mkv & last)


def prepare(k, v, g, beta, ch: Chunks, Ai=None, wu: bool = True, gamma_out=None, q=None, pairs_out=None,
            bound_out=None):
    """The per-chunk factors of a delta member: (Ai [T, HV, BT] = T⁻¹ rows, W [T, HV, K], U [T, HV, V]),
    in the inputs' dtype; (None, None, None) without the delta term. ``Ai``, when given (the
    backward passes the forward's), is used instead of being computed again. Without ``wu`` only
    Ai is made (W and U None): for the state passes that form δ from T (``FROM_INV``).
    ``gamma_out`` [T, HV] fp32: filled with γ by the inverse's kernel (gated members, Ai not given).
    ``pairs_out`` [T, HV, BT] in the inputs' dtype (with ``q``; Ai not given): filled with the rows of
    each chunk's Q Kᵀ ⊙ D by the same kernel. ``bound_out`` [NT, HV] fp32 (gated members, Ai not
    given): filled with each chunk's log norm bound (split.bounds) by the same kernel."""
    if beta is None:
        return None, None, None
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    prec, DT, io, dev = dot_precision(v.dtype), tl_dtype(v.dtype), v.dtype, v.device
    gp = g if g is not None else beta
    if Ai is None:
        Ai = torch.empty(T, HV, BT, device=dev, dtype=io)
        BK, _ = tiles("kkt_solve", K, V, io=io)
        store_g = g is not None and gamma_out is not None
        store_p = pairs_out is not None
        store_b = g is not None and bound_out is not None
        launch(kkt_solve_kernel, (ch.NT, HV), k, gp, beta, Ai, gamma_out if store_g else gp,
               q if store_p else k, pairs_out if store_p else Ai, bound_out if store_b else gp, ch.cu, ch.chunk_idx,
               H=H, HV=HV, K=K, BK=BK, USE_G=g is not None, PREC=prec,
               INV=DELTA["kkt_solve"]["INV"] if DT != tl.float32 else "ieee", STORE_G=store_g, STORE_P=store_p,
               STORE_B=store_b, name="kkt_solve", io=io)
    if not wu:
        return Ai, None, None
    W = torch.empty(T, HV, K, device=dev, dtype=io)
    U = torch.empty(T, HV, V, device=dev, dtype=io)
    BK, BV = tiles("wu", K, V)
    launch(wu_kernel, (ch.NT, HV), k, v, gp, beta, Ai, W, U, ch.cu, ch.chunk_idx, H=H, HV=HV, K=K, V=V, BT=BT,
           BK=BK, BV=BV, USE_G=g is not None, PREC=prec, DT=DT, name="wu")
    return Ai, W, U


def state_tile(name: str, ch: Chunks, HV: int, K: int, V: int, device) -> tuple[int, int]:
    """(BK, BV) of a sequential pass (state_fwd, state_out, state_bwd): the whole K, and the
    configured widest value tile, its width halved (down to ``DELTA[name]["BV_min"]``) while the
    (sequence, head, tile) programs number fewer than the card's multiprocessors: twice as many
    programs, each with half the values (the pass is latency-bound: one chunk step after another).
    The pipeline depth is the launch's (:func:`gdn.ops.triton.launch.by_waves`).
    Measured on the H200: value tiles of 16 instead of 32 at 1 × 32768: fwd 1.50 → 1.42 ms."""
    c, sms = DELTA[name], sm_count(device)
    SK, SV = tiles(name, K, V)
    while ch.N * HV * cdiv(V, SV) < sms and SV // 2 >= c["BV_min"]:
        SV //= 2
    return SK, SV


def gamma_of(g, ch: Chunks, gamma=None):
    """γ [T, HV] fp32, the in-chunk cumulative log decay the sequential passes read: ``gamma`` when
    the caller has it (the backward gets the forward's, the forward the inverse kernel's), else
    computed (None without a gate)."""
    if g is None or gamma is not None:
        return gamma
    return chunk_cumsum(g, ch)


def _gamma_buffer(g, beta, Ai, ch: Chunks, plans=None):
    """(γ [T, HV], the chunks' bounds [NT, HV]) where the inverse's kernel writes them (a gated delta
    member whose inverse is computed here; else (None, None)): views of one fp32 buffer, one
    allocation. The bounds go into ``plans["bound"]`` (when ``plans`` is a dict), where the warm-up
    walks of this call and of its backward find them (split.bounds)."""
    if g is None or beta is None or Ai is not None:
        return None, None
    buf = torch.empty(g.shape[0] + ch.NT, g.shape[1], device=g.device, dtype=torch.float32)
    G, bnd = buf[:g.shape[0]], buf[g.shape[0]:]
    if plans is not None:
        plans["bound"] = bnd
    return G, bnd


@functools.cache  # (an import statement costs a lookup through the import system at each call)
def _fused_fwd():
    """The warp-specialised forward pass's module (delta.triton.fused_fwd), imported on first use;
    None where this triton has no Gluon."""
    try:
        from . import fused_fwd  # noqa: PLC0415
    except ImportError:
        return None
    return fused_fwd


def warp_specialised(q, g, beta, K: int, V: int, name: str = "fused_fwd") -> bool:
    """Whether a sequential pass is the warp-specialised one (delta.triton.fused_fwd; ``fused_fwd``
    the forward's, δ from the inverse; ``fused_states`` the backward's recomputed state pass): on,
    and the call is one it takes."""
    if not (DELTA[name]["on"] and (name != "fused_fwd" or DELTA["state_out"].get("from_inverse", False))):
        return False
    ws = _fused_fwd()
    return ws is not None and ws.usable(q, g, beta, K, V, name)


def forward(q, k, v, g, beta, h0, ch: Chunks, want_final: bool, scale: float, out_dtype, ws: bool | None = None,
            plans=None):
    """The forward of one call: (o [T, HV, V] in ``out_dtype``, final state [N, HV, K, V] fp32 or
    None, Ai or None, γ or None). q, k: [T, H, K]; v: [T, HV, V] (one dtype); g, beta: [T, HV] fp32 or None.
    kkt_solve and wu, then one fused sequential pass (:func:`state_out_kernel`); with
    ``DELTA["state_out"]["from_inverse"]`` no wu: the pass forms δ from T⁻¹, v and β. With
    ``DELTA["fused_fwd"]["on"]`` the warp-specialised form of that pass (delta.triton.fused_fwd)
    runs where it applies (``ws``: whether it does, when the caller knows; ``plans``: a dict that
    keeps the call's chunk bounds and warm-up counts for the backward, split.bounds and
    fused_fwd._run)."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    dev = v.device
    from_inv = beta is not None and DELTA["state_out"].get("from_inverse", False)
    plans = {} if plans is None else plans
    G, bnd = _gamma_buffer(g, beta, None, ch, plans)
    ws = warp_specialised(q, g, beta, K, V) if ws is None else ws
    # the pair matrix Q Kᵀ ⊙ D from kkt_solve (delta members, which run it) instead of per value tile
    # (the warp-specialised pass forms it itself, beside its chain)
    pairs = torch.empty(T, HV, BT, device=dev, dtype=v.dtype) if beta is not None and not ws else None
    Ai, W, U = prepare(k, v, g, beta, ch, wu=not from_inv, gamma_out=G, q=q, pairs_out=pairs, bound_out=bnd)
    o = torch.empty(T, HV, V, device=dev, dtype=out_dtype)
    ht = torch.empty(ch.N, HV, K, V, device=dev, dtype=torch.float32) if want_final else None
    G = gamma_of(g, ch, G)
    if ws:
        _fused_fwd().forward(q, k, v, G, beta, Ai, h0, o, ht if want_final else None, ch, scale, plans)
        return o, ht, Ai, G
    SK, SV = state_tile("state_out", ch, HV, K, V, dev)
    gp = G if G is not None else v
    # warm-started segments when the sequences' programs would not fill the card (gated members)
    L = split_len(ch, HV, cdiv(V, SV), dev) if warm_split(g) else 0
    # the δ-from-inverse pass may read q, k, v and T⁻¹ through tensor descriptors (not the warm
    # form: its walk reads k and β by address)
    reads = ((q, K), (k, K), (v, SV), (Ai, BT)) + (((pairs, BT),) if pairs is not None else ())
    tma, tiles_ = tile_reads("state_out", *reads) if from_inv and not L else (False, (q, k, v, Ai if from_inv else v, pairs))
    qa, ka, va, aa = tiles_[:4]
    pa = tiles_[4] if pairs is not None else v
    seqs = ch.N
    cu, seg_seq, warm = ch.cu, ch.cu, {}
    if L:
        sg = make_segments(ch, L, dev)
        seqs, cu, seg_seq = sg.NS, sg.cu, sg.seq
        warm = dict(WARM=True, LOG_EPS=float(DELTA["split"]["log_eps"]))
    bnd = bounds(k, beta, G, ch, HV, plans) if L else None
    launch(state_out_kernel, (cdiv(V, SV), seqs * HV), qa, ka, va, gp, W if W is not None else v,
           U if U is not None else v, aa, beta if beta is not None else v, pa,
           h0 if h0 is not None else v, o, ht if want_final else v, cu,
           scale, H=H, HV=HV, seg_seq=seg_seq, seq_cu=ch.cu, seq_off=ch.chunk_off, Bnd=bnd if bnd is not None else gp,
           K=K, V=V, BT=BT, BK=SK, BV=SV, USE_G=g is not None,
           DELTA=beta is not None, USE_INIT=h0 is not None, STORE_FINAL=want_final, PREC=dot_precision(v.dtype),
           DT=tl_dtype(v.dtype), WHILE=INTERPRET, FROM_INV=from_inv, TMA=tma, PRE_P=pairs is not None,
           name="state_out", **warm)
    if L:
        fill_empty(ht, h0, ch)
    return o, ht, Ai, G


def tile_reads(name: str, *reads) -> tuple:
    """(TMA, tensors) for sequential pass ``name``'s per-chunk inputs ``reads`` [(x [T, heads, width],
    block columns)]: with ``DELTA[name]["TMA"]``, and where every x is contiguous, 16-byte aligned
    and on a GPU with the tensor-memory accelerator (compute capability 9 or later; the interpreter
    reads descriptors too), (True, a tensor descriptor of each x as the row-major [T, heads × width]
    matrix, read in blocks of one chunk's rows and its block columns); else (False, the x as given)."""
    xs = tuple(x for x, _ in reads)
    ready = DELTA[name]["TMA"] and all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in xs) and has_tma(xs[0])
    if not ready:
        return False, xs
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

    return True, tuple(TensorDescriptor.from_tensor(x.view(x.shape[0], -1), block_shape=[BT, c]) for x, c in reads)


def forward_intermediates(q, k, v, g, beta, h0, ch: Chunks, want_final: bool, Ai=None, from_inverse=False,
                          gamma=None, plans=None, pad: int = 0, pad_L: int = 0):
    """Run the sequential part of the forward, storing what the backward needs: returns
    (h [NT, HV, K, V], VN or None, ht or None, Ai or None, W or None, γ or None); h, VN, Ai, W in
    the inputs' dtype, ht and γ fp32. q, k: [T, H, K]; v: [T, HV, V] (q, k, v of one dtype); g, beta:
    [T, HV] fp32 or None. ``Ai`` [T, HV, BT] and ``gamma`` [T, HV], when given (the backward passes
    the forward's), are used instead of being computed again, and so are the chunk bounds and
    warm-up counts in ``plans`` (split.bounds, fused_fwd._run), where this call leaves its own. ``from_inverse``: no wu; the pass forms δ from T⁻¹, v and β, and W comes
    back None (the backward, whose state pass reads W, keeps wu). ``pad``: h has min(pad, its chunks)
    free rows after each sequence's states, or with ``pad_L`` after each segment's of pad_L chunks
    (common.state_rows: where the backward's sliced dS_out go), h [rows, HV, K, V]; the segments'
    pads only where this pass runs those segments (else h comes without pads: NT rows)."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    delta = beta is not None
    from_inv = delta and from_inverse
    prec, DT, io = dot_precision(v.dtype), tl_dtype(v.dtype), v.dtype
    dev = v.device
    plans = {} if plans is None else plans
    fill, bnd = _gamma_buffer(g, beta, Ai, ch, plans) if gamma is None else (None, None)
    Ai, W, U = prepare(k, v, g, beta, ch, Ai, wu=not from_inv, gamma_out=fill, bound_out=bnd)
    gamma = fill if gamma is None else gamma
    VN = torch.empty(T, HV, V, device=dev, dtype=io) if delta else None
    SK, SV = tiles("state_fwd", K, V)
    fused = from_inv and warp_specialised(k, g, beta, K, V, "fused_states")
    L = _fused_fwd().split_of(ch, HV, V, dev, g) if fused else split_len(ch, HV, cdiv(V, SV), dev, warm_split(g))
    if pad_L and L != pad_L:  # pads between segments this pass does not run: none
        pad = pad_L = 0
    h_off, rows = state_rows(ch, pad, dev, pad_L, pad_L)  # (h_off: the whole sequences' rows, for the unsplit pass)
    h = torch.empty(rows, HV, K, V, device=dev, dtype=io)
    ht = torch.empty(ch.N, HV, K, V, device=dev, dtype=torch.float32) if want_final else None
    dummy = v
    common = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=SK, USE_G=g is not None, DELTA=delta, PREC=prec, DT=DT,
                  WHILE=INTERPRET, FROM_INV=from_inv, seg_seq=ch.cu, seq_cu=ch.cu, seq_off=ch.chunk_off, Bnd=v,
                  name="state_fwd")
    # the state passes read γ (the in-chunk cumulative decay), computed once per forward + backward
    G = gamma_of(g, ch, gamma)
    if fused:
        _fused_fwd().states(k, v, G, beta, Ai, h0, h, VN, ht, ch, plans, pad, pad_L)
        return h, VN, ht, Ai, W, G
    gp = G if G is not None else dummy
    Wp, Up = (W, U) if delta and not from_inv else (dummy, dummy)
    Ap, bp = (Ai, beta) if from_inv else (dummy, dummy)
    if L and warm_split(g):
        # Warm-started split pass: every segment starts a bounded walk back before its first chunk
        # (state_fwd_kernel's WARM form); one launch, no maps, no chain
        sg = make_segments(ch, L, dev)
        bnd = bounds(k, beta, G, ch, HV, plans)
        launch(state_fwd_kernel, (cdiv(V, SV), sg.NS * HV), k, v, gp, Wp, Up, Ap, beta if delta else dummy,
               h0 if h0 is not None else dummy, h, VN if delta else dummy, ht if want_final else dummy, sg.cu,
               state_rows(ch, pad, dev, L, pad_L)[0], BV=SV, USE_INIT=h0 is not None, STORE_FINAL=want_final, WARM=True,
               LOG_EPS=float(DELTA["split"]["log_eps"]),
               **dict(common, seg_seq=sg.seq, Bnd=bnd if bnd is not None else dummy))
        fill_empty(ht, h0, ch)
        return h, VN, ht, Ai, W, G
    if L:
        # Split pass: (1) every segment from [I | 0] gives its map S ↦ A S + B; (2) chain the maps
        # along each sequence; (3) every segment again from its true entering state, storing h, δ.
        sg = make_segments(ch, L, dev)
        X = torch.empty(sg.NS, HV, K, K + V, device=dev, dtype=torch.float32)
        AV = min(pow2(K + V), max(16, DELTA["state_aug"]["SV"] // SK))
        launch(state_fwd_kernel, (cdiv(K + V, AV), sg.NS * HV), k, v, gp, Wp, Up, Ap, bp, dummy, dummy, dummy,
               X, sg.cu, sg.off, BV=AV, USE_INIT=False, STORE_FINAL=True, AUG=True, **dict(common, name="state_aug"))
        Sin = chain(X, h0, ht, sg, HV, K, V, False, prec)
        launch(state_fwd_kernel, (cdiv(V, SV), sg.NS * HV), k, v, gp, Wp, Up, Ap, bp, Sin, h,
               VN if delta else dummy, dummy, sg.cu, state_rows(ch, pad, dev, L, pad_L)[0], BV=SV, USE_INIT=True,
               STORE_FINAL=False, **common)
        return h, VN, ht, Ai, W, G
    SK, SV = state_tile("state_fwd", ch, HV, K, V, dev)
    # the per-chunk inputs, perhaps as tensor descriptors
    if from_inv:
        tma, (k, v, Ap) = tile_reads("state_fwd", (k, K), (v, SV), (Ai, BT))
    elif delta:
        tma, (k, v, Wp, Up) = tile_reads("state_fwd", (k, K), (v, SV), (W, K), (U, SV))
    else:
        tma, (k, v) = tile_reads("state_fwd", (k, K), (v, SV))
    launch(state_fwd_kernel, (cdiv(V, SV), ch.N * HV),
           k, v, gp, Wp, Up, Ap, bp, h0 if h0 is not None else dummy, h, VN if delta else dummy,
           ht if want_final else dummy,
           ch.cu, h_off, BV=SV, USE_INIT=h0 is not None, STORE_FINAL=want_final, TMA=tma, **common)
    return h, VN, ht, Ai, W, G


def output(q, k, v, g, h, VN, ch: Chunks, scale: float, out_dtype):
    """o [T, HV, V] in ``out_dtype`` from the per-chunk states h and corrected values VN."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    o = torch.empty(T, HV, V, device=v.device, dtype=out_dtype)
    BK, BV = tiles("output", K, V)
    if v.dtype != torch.float32:
        # value tiles of at least 64 for half inputs, whatever the launch table says: triton 3.6 on
        # the H200 compiles this kernel's 16- and 32-wide ones wrong (o off by 180 % at V = 16 and
        # by 240 % at K = 128, BV = 32; docs/TRITON.md, "Rules from the GPU")
        BV = max(BV, min(64, pow2(V)))
    launch(output_kernel, (cdiv(V, BV), ch.NT, HV),
           q, k, v, g if g is not None else v, h, VN if VN is not None else v, o, ch.cu, ch.chunk_idx, scale,
           H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, USE_G=g is not None, DELTA=VN is not None,
           PREC=dot_precision(v.dtype), DT=tl_dtype(v.dtype), name="output")
    return o
