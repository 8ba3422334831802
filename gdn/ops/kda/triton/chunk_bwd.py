"""Backward kernels of the chunkwise Kimi Delta Attention: the mirror of :mod:`.chunk_fwd`.

Per chunk, with dO the output gradient, dS' the gradient of the state leaving the chunk (from the
next chunk, or the final-state gradient), S the state entering it, Q̃ = Q ⊙ Γ and
K̃ = K ⊙ exp(γ_C − γ)::

    dδ  = scale Pᵀ dO + K̃ dS'                                  dv_local, state pass (reverse)
    dS  = diag(exp γ_C) dS' + scale Q̃ᵀ dO − Wᵀ dδ              state pass (QG = scale Q̃ stored)
    dP  = scale dO δᵀ (j ≤ i);  dQ̃ = scale dO Sᵀ;  dK̃ = δ dS'ᵀ;  dW = −dδ Sᵀ        dqk
    dT  = dδ (βV)ᵀ + dW (β K ⊙ Γ)ᵀ;  dA = −Tᵀ dT Tᵀ (j < i)                          wy_bwd
    dV  = β Tᵀ dδ;  d(K ⊙ Γ) = β Tᵀ dW;  dβ gets vᵢ·(Tᵀdδ)ᵢ + (k ⊙ Γ)ᵢ·(TᵀdW)ᵢ      wy_bwd
    through P and A (per channel c, pairs j ≤ i):                                     intra_bwd
        dq_ic += Σ_j dP_ij k_jc e_ijc,   dk_jc += Σ_i dP_ij q_ic e_ijc,   e_ijc = exp(γ_ic − γ_jc)
        r_ic   = Σ_j dA_ij k_jc e_ijc:   dk_i += β_i r_i,  dβ_i += k_i·r_i
        dk_jc += Σ_i β_i dA_ij k_ic e_ijc

Every γ-dependence is a product with exp(±γ), so dγ is read off the gradients of the rescaled
factors: each term x ⊙ exp(γ) gives dγ += x ⊙ dx-term and each x ⊙ exp(−γ) gives dγ −= …; the
state decay exp(γ_C) adds exp(γ_C) ⊙ rowsum(S ⊙ dS') to γ_C. dg is the reverse in-chunk cumsum of
dγ (γ_C is γ at the chunk's last row). The pair sums over P and A use the same 16-row sub-blocks
as the forward (:mod:`.chunk_fwd`), so no exponent is above SPAN.

dQ, dK, dγ, dβ, dV are fp32; dq and dk are per value head (the caller sums each group).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...triton.common import INTERPRET, Chunks, chunk_bounds, dot_precision, tl_dtype
from .chunk_fwd import (SPAN, STATE_DTYPE, after_ref, before_ref, block_span, chunk_rows, entry, forward_intermediates,
                        ktile, launch, load_rows, ref_row, state_vtile, vtile)


@triton.jit
def dv_local_kernel(P, do, DVL, cu, chunk_idx, scale, HV, V: tl.constexpr, BV: tl.constexpr,
                    PREC: tl.constexpr, DT: tl.constexpr):
    """DVL = scale · Pᵀ dO for one chunk, value head and V tile."""
    i_v, i_t, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, t0, eos = chunk_bounds(cu, chunk_idx, i_t, 64)
    o_t = tl.arange(0, 64)
    rows = t0 + o_t
    m = rows < eos
    o_v = i_v * BV + tl.arange(0, BV)
    b_p = tl.load(P + (rows[:, None] * HV + i_hv) * 64 + o_t[None, :], mask=m[:, None], other=0.0)
    b_do = tl.load(do + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=m[:, None], other=0.0)
    b_dv = scale * tl.dot(tl.trans(b_p), b_do, input_precision=PREC)
    tl.store(DVL + (rows[:, None] * HV + i_hv) * V + o_v[None, :], b_dv.to(DT), mask=m[:, None])


@triton.jit
def _state_bwd_step(j, b_ds, NC, QG, KT, G, W, do, DVL, dh, DD, bos, eos, c0, i_hv, o_t, o_k, o_v, p_s,
                    scale, HV, K: tl.constexpr, V: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Step j of the reverse pass (chunk NC − 1 − j): store dS', compute dδ, return dS."""
    i_c = NC - 1 - j
    b_dsd = b_ds.to(DT)
    tl.store(dh + ((c0 + i_c) * HV + i_hv) * K * V + p_s, b_ds.to(dh.dtype.element_ty))
    cs = bos + i_c * 64
    rows = cs + o_t
    m = (rows >= bos) & (rows < eos)
    last = tl.minimum(eos, cs + 64) - 1
    b_gc = tl.load(G + (last * HV + i_hv) * K + o_k, mask=(i_c >= 0) & (o_k < K), other=0.0)
    p_k = (rows[:, None] * HV + i_hv) * K + o_k[None, :]
    b_qg = tl.load(QG + p_k, mask=m[:, None], other=0.0)
    b_kt = tl.load(KT + p_k, mask=m[:, None], other=0.0)
    b_do = tl.load(do + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=m[:, None], other=0.0)
    b_dd = load_rows(DVL, rows, m, HV, i_hv, o_v, V) + tl.dot(b_kt, b_dsd, input_precision=PREC)
    b_ddd = b_dd.to(DT)
    tl.store(DD + (rows[:, None] * HV + i_hv) * V + o_v[None, :], b_ddd, mask=m[:, None])
    b_w = tl.load(W + p_k, mask=m[:, None], other=0.0)
    # QG carries the scale: both dots accumulate into the decayed dS' in place
    b_ds = tl.dot(tl.trans(b_qg), b_do, acc=b_ds * tl.exp(b_gc)[:, None], input_precision=PREC)
    return tl.dot(tl.trans(b_w), -b_ddd, acc=b_ds, input_precision=PREC)


@triton.jit
def state_bwd_kernel(QG, KT, G, W, do, DVL, dht, dh, DD, dh0, cu, chunk_off, scale, HV,
                     K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr,
                     USE_INIT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, WHILE: tl.constexpr):
    """Reverse pass over one sequence's chunks (its own count: in a packed batch a short sequence's
    programs end early): dh[c] = dS' of chunk c, DD = dδ, dh0 = dS_0."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_off + i_n).to(tl.int64)
    NC = tl.cdiv(eos - bos, 64)
    o_t = tl.arange(0, 64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_s = o_k[:, None] * V + o_v[None, :]
    b_ds = tl.zeros([K, BV], dtype=tl.float32)
    if USE_DHT:
        b_ds = tl.load(dht + (i_n * HV + i_hv).to(tl.int64) * K * V + p_s).to(tl.float32)
    if WHILE:
        j = 0
        while j < NC:
            b_ds = _state_bwd_step(j, b_ds, NC, QG, KT, G, W, do, DVL, dh, DD, bos, eos, c0, i_hv, o_t, o_k, o_v,
                                   p_s, scale, HV, K, V, PREC, DT)
            j += 1
    else:
        for j in range(0, NC):
            b_ds = _state_bwd_step(j, b_ds, NC, QG, KT, G, W, do, DVL, dh, DD, bos, eos, c0, i_hv, o_t, o_k, o_v,
                                   p_s, scale, HV, K, V, PREC, DT)
    if USE_INIT:
        tl.store(dh0 + (i_n * HV + i_hv).to(tl.int64) * K * V + p_s, b_ds)


@triton.jit
def dqk_kernel(q, k, G, VN, do, h, dh, DD, DQ, DK, DW, DGAM, DP, cu, chunk_idx, scale, H, HV,
               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Per chunk and value head, program i_k < K / BK (a K tile): the state terms of dQ and dK,
    dW = −dδ Sᵀ, DGAM = dγ + k ⊙ dK of these terms (the γ_C terms on the chunk's last row; in
    that sum the −k ⊙ dK term of dγ cancels, and wy_bwd and intra_bwd add to DK alone); the
    program after the last K tile: dP = scale dO δᵀ (fp32, columns 0–63 of the [T, HV, 128] buffer
    it shares with wy_bwd's dA). dP has a program of its own so that its [64, 64] accumulator is
    never live beside the K tile's three (the two branches are disjoint: the kernel holds the
    larger of the two, not their sum).

    Every dot here takes fp32 operands (tf32 for half inputs, 3-pass tf32 for fp32) and the states
    are fp32 (``STATE_DTYPE``): dγ sums these terms per channel, and they cancel in dg's reverse
    cumsum, so half-precision operands here cost dg about twice the error of the half inputs
    themselves (measured with fp16 under the interpreter, strong decay: dg 4.6e-4 with fp16 operands,
    3.2e-4 with fp32, 1.6e-4 for the fp32 chunk form on the same inputs)."""
    i_k, i_t, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, t0, nv = chunk_rows(cu, chunk_idx, i_t)
    VN += t0 * HV * V
    do += t0 * HV * V
    o_t = tl.arange(0, 64)
    m = o_t < nv
    if i_k == K // BK:
        DP += t0 * HV * 128
        b_dp = tl.zeros([64, 64], dtype=tl.float32)
        for i_v in range(0, V // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            b_d = load_rows(VN, o_t, m, HV, i_hv, o_v, V)
            b_do = load_rows(do, o_t, m, HV, i_hv, o_v, V)
            b_dp += tl.dot(b_do, tl.trans(b_d), input_precision=PREC)
        b_dp = tl.where((o_t[:, None] >= o_t[None, :]) & m[:, None], b_dp * scale, 0.0)
        tl.store(DP + (o_t[:, None] * HV + i_hv) * 128 + o_t[None, :], b_dp, mask=m[:, None])
    else:
        DD += t0 * HV * V
        h += (i_t.to(tl.int64) * HV + i_hv) * K * V
        dh += (i_t.to(tl.int64) * HV + i_hv) * K * V
        o_k = i_k * BK + tl.arange(0, BK)
        b_dqs = tl.zeros([64, BK], dtype=tl.float32)
        b_dks = tl.zeros([64, BK], dtype=tl.float32)
        b_dw = tl.zeros([64, BK], dtype=tl.float32)  # −dW: every dot accumulates in place
        b_gcs = tl.zeros([BK], dtype=tl.float32)
        for i_v in range(0, V // BV):
            o_v = i_v * BV + tl.arange(0, BV)
            b_d = load_rows(VN, o_t, m, HV, i_hv, o_v, V)
            b_do = load_rows(do, o_t, m, HV, i_hv, o_v, V)
            b_dd = load_rows(DD, o_t, m, HV, i_hv, o_v, V)
            b_s = tl.load(h + o_k[:, None] * V + o_v[None, :])
            b_ds = tl.load(dh + o_k[:, None] * V + o_v[None, :])
            b_gcs += tl.sum(b_s * b_ds, axis=1)
            b_dqs = tl.dot(b_do, tl.trans(b_s), acc=b_dqs, input_precision=PREC)
            b_dks = tl.dot(b_d, tl.trans(b_ds), acc=b_dks, input_precision=PREC)
            b_dw = tl.dot(b_dd, tl.trans(b_s), acc=b_dw, input_precision=PREC)
        # each result stored as soon as it is final, so that few [64, BK] tiles are live at once
        q += t0 * H * K
        k += t0 * H * K
        G += t0 * HV * K
        DW += t0 * HV * K
        DQ += t0 * HV * K
        DK += t0 * HV * K
        DGAM += t0 * HV * K
        p_k = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
        tl.store(DW + p_k, (-b_dw).to(DW.dtype.element_ty), mask=m[:, None])
        b_g = load_rows(G, o_t, m, HV, i_hv, o_k, K)
        b_gc = tl.load(G + ((nv - 1) * HV + i_hv) * K + o_k)
        b_dk = b_dks * tl.exp(b_gc[None, :] - b_g)
        tl.store(DK + p_k, b_dk, mask=m[:, None])
        b_end = tl.sum(load_rows(k, o_t, m, H, i_h, o_k, K) * b_dk, axis=0) + tl.exp(b_gc) * b_gcs
        b_dq = b_dqs * (scale * tl.exp(b_g))
        tl.store(DQ + p_k, b_dq, mask=m[:, None])
        # DGAM holds dγ + k ⊙ DK (the −k ⊙ dK term of dγ cancels there)
        b_dgam = (load_rows(q, o_t, m, H, i_h, o_k, K) * b_dq
                  + tl.where((o_t == nv - 1)[:, None], b_end[None, :], 0.0))
        tl.store(DGAM + p_k, b_dgam, mask=m[:, None])


@triton.jit
def wy_bwd_kernel(k, v, G, beta, Ai, DD, DW, DKW, DV, DB, DA, cu, chunk_idx, H, HV, K: tl.constexpr,
                  V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """Gradients through W = T diag(β)(K ⊙ Γ), U = T diag(β) V: dV, the W/U part of dβ, the
    d(K ⊙ Γ) part of dK into DKW (its dγ term is k ⊙ DKW, which intra_bwd adds), and
    dA = −Tᵀ dT Tᵀ (strictly lower, fp32) for :func:`intra_bwd_kernel`."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, t0, nv = chunk_rows(cu, chunk_idx, i_t)
    k += t0 * H * K
    v += t0 * HV * V
    G += t0 * HV * K
    beta += t0 * HV
    Ai += t0 * HV * 64
    DD += t0 * HV * V
    DW += t0 * HV * K
    DKW += t0 * HV * K
    DV += t0 * HV * V
    DB += t0 * HV
    DA += t0 * HV * 128 + 64
    o_t = tl.arange(0, 64)
    m = o_t < nv
    b_b = tl.load(beta + o_t * HV + i_hv, mask=m, other=0.0)
    b_A = tl.load(Ai + (o_t[:, None] * HV + i_hv) * 64 + o_t[None, :], mask=m[:, None], other=0.0)
    b_dT = tl.zeros([64, 64], dtype=tl.float32)
    b_db = tl.zeros([64], dtype=tl.float32)
    for i_v in range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_v = (o_t[:, None] * HV + i_hv) * V + o_v[None, :]
        b_du = tl.load(DD + p_v, mask=m[:, None], other=0.0)
        b_v = load_rows(v, o_t, m, HV, i_hv, o_v, V)
        b_dT += tl.dot(b_du, tl.trans((b_v * b_b[:, None]).to(DT)), input_precision=PREC)
        b_tdu = tl.dot(tl.trans(b_A), b_du, input_precision=PREC)
        tl.store(DV + p_v, b_tdu * b_b[:, None], mask=m[:, None])
        b_db += tl.sum(b_v * b_tdu, axis=1)
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = (o_t[:, None] * HV + i_hv) * K + o_k[None, :]
        b_dw = tl.load(DW + p_k, mask=m[:, None], other=0.0)
        b_eg = tl.exp(load_rows(G, o_t, m, HV, i_hv, o_k, K))
        b_kg = load_rows(k, o_t, m, H, i_h, o_k, K) * b_eg
        b_dT += tl.dot(b_dw, tl.trans((b_kg * b_b[:, None]).to(DT)), input_precision=PREC)
        b_tdw = tl.dot(tl.trans(b_A), b_dw, input_precision=PREC)
        b_db += tl.sum(b_kg * b_tdw, axis=1)
        tl.store(DKW + p_k, b_tdw * (b_b[:, None] * b_eg), mask=m[:, None])  # d(K ⊙ Γ) ⊙ Γ
    b_Af = b_A.to(tl.float32)
    b_dA = -tl.dot(tl.dot(tl.trans(b_Af), b_dT, input_precision=PREC), tl.trans(b_Af), input_precision=PREC)
    b_dA = tl.where((o_t[:, None] > o_t[None, :]) & m[:, None], b_dA, 0.0)
    tl.store(DA + (o_t[:, None] * HV + i_hv) * 128 + o_t[None, :], b_dA, mask=m[:, None])
    tl.store(DB + o_t * HV + i_hv, b_db, mask=m)


@triton.jit
def _pair_block(X_, r_i, m_i, col0, HV, i_hv):
    """Rows r_i, columns col0 … col0 + 15 of dP or dA (DP + 64) in the [T, HV, 128] fp32 buffer of
    both (0 off the sequence)."""
    o = tl.arange(0, 16)
    return tl.load(X_ + (r_i[:, None] * HV + i_hv) * 128 + col0 + o[None, :], mask=m_i[:, None], other=0.0)


@triton.jit
def _diag_pairwise(q_i, k_i, g_i, b_i, m_i, k, G, DP, DA, r_i, row0, col0, nv, H, HV, i_h, i_hv, o_k,
                   K: tl.constexpr):
    """The diagonal block's four products (dq and r of its rows, dk through P and through A of its
    columns) with pairwise exponents exp(γ_i − γ_j), j ≤ i, for a block across which some channel
    decays by more than SPAN: one column j at a time, its k and γ row and its dP, dA column read
    from memory, so no [16, 16, BK] tile is ever live (the branch is rare; its registers are not)."""
    o = tl.arange(0, 16)
    b_dq = tl.zeros_like(k_i)
    b_r = tl.zeros_like(k_i)
    b_dkp = tl.zeros_like(k_i)
    b_dka = tl.zeros_like(k_i)
    for j in range(16):
        rj = row0 + j
        mj = rj < nv
        k_j = tl.load(k + (rj * H + i_h) * K + o_k, mask=mj, other=0.0).to(tl.float32)
        g_j = tl.load(G + (rj * HV + i_hv) * K + o_k, mask=mj, other=0.0).to(tl.float32)
        keep = (o >= j) & m_i
        e = tl.exp(tl.where(keep[:, None], g_i - g_j[None, :], float("-inf")))  # [16, BK], rows i ≥ j
        dp = tl.load(DP + (r_i * HV + i_hv) * 128 + col0 + j, mask=keep, other=0.0)
        da = tl.load(DA + (r_i * HV + i_hv) * 128 + col0 + j, mask=keep, other=0.0)
        ke = k_j[None, :] * e
        b_dq += dp[:, None] * ke
        b_r += da[:, None] * ke
        at_j = (o == j)[:, None]
        b_dkp += tl.where(at_j, tl.sum(dp[:, None] * q_i * e, axis=0)[None, :], 0.0)
        b_dka += tl.where(at_j, tl.sum((da * b_i)[:, None] * k_i * e, axis=0)[None, :], 0.0)
    return b_dq, b_r, b_dkp, b_dka


@triton.jit
def _row_pairs(acc_q, acc_r, I, k, G, DP, DA, r_i, m_i, g_r, nv, H, HV, i_h, i_hv, o_k, K: tl.constexpr,
               PREC: tl.constexpr):
    """The row side of the pairs (I, J < I): dq and r of rows I (before their row factor) summed
    over the earlier column blocks J, through block I's reference row."""
    o = tl.arange(0, 16)
    J = 0
    while J < I:
        r_j = J * 16 + o
        m_j = r_j < nv
        k_j = load_rows(k, r_j, m_j, H, i_h, o_k, K) * before_ref(load_rows(G, r_j, m_j, HV, i_hv, o_k, K), g_r)
        acc_q += tl.dot(_pair_block(DP, r_i, m_i, J * 16, HV, i_hv), k_j, input_precision=PREC)
        acc_r += tl.dot(_pair_block(DA, r_i, m_i, J * 16, HV, i_hv), k_j, input_precision=PREC)
        J += 1
    return acc_q, acc_r


@triton.jit
def _col_pairs(I, qe_i, keb_i, G, DP, DA, DK, r_i, m_i, g_r, nv, HV, i_hv, o_k, K: tl.constexpr, PREC: tl.constexpr):
    """The column side of the pairs (I, J < I): dk of rows J through P and A, added into DK for
    block J's own turn (its dγ term needs nothing: DGAM holds dγ + k ⊙ DK). keb_i = β ⊙ k ⊙ e of
    rows I."""
    o = tl.arange(0, 16)
    J = 0
    while J < I:
        r_j = J * 16 + o
        m_j = r_j < nv
        f_j = before_ref(load_rows(G, r_j, m_j, HV, i_hv, o_k, K), g_r)
        dkc_j = (tl.dot(tl.trans(_pair_block(DP, r_i, m_i, J * 16, HV, i_hv)), qe_i, input_precision=PREC)
                 + tl.dot(tl.trans(_pair_block(DA, r_i, m_i, J * 16, HV, i_hv)), keb_i, input_precision=PREC)) * f_j
        p_j = (r_j[:, None] * HV + i_hv) * K + o_k[None, :]
        tl.store(DK + p_j, tl.load(DK + p_j, mask=m_j[:, None], other=0.0) + dkc_j, mask=m_j[:, None])
        J += 1


@triton.jit(do_not_specialize=["T"])
def intra_bwd_kernel(q, k, G, beta, DP, DQ, DK, DQO, DKO, DGAM, DG, DBK, cu, chunk_idx, T, H, HV,
                     K: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, SPAN: tl.constexpr,
                     SPLIT: tl.constexpr = False):
    """Per chunk, value head and K tile: the gradients through P and A (see the module docstring),
    added to the fp32 partials (DQ, DK, wy_bwd's dK term in DG, and DGAM = dγ + k ⊙ DK), the final
    dq and dk stored into DQO, DKO (in their own dtype; they may be DQ and DK themselves), this K
    tile's part of dβ into DBK [NK, T, HV], then dg = the reverse in-chunk cumsum of dγ into DG,
    over wy_bwd's term (each block's rows of it are read before dg is written there). Row blocks
    are visited last first, carrying the cumsum.

    Each off-diagonal pair of blocks (I, J < I) is visited once, in block I's turn, through I's
    reference row: its row side (dq and r of rows I) is summed in registers, its column side (dk
    of rows J through P and A) is added into DK at rows J, which block J's own turn, later, reads
    back (DGAM needs no update: it holds dγ + k ⊙ DK). Both sides share the pair blocks dP_IJ,
    dA_IJ, the column factor exp(γ_r − γ_J) and the row factor exp(γ_I − γ_r) (each ≤ 1).
    ``SPLIT``: the two sides in separate loops (fewer live tiles: 3-pass tf32, whose operands are
    two tiles each), else in one."""
    i_k, i_t, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, t0, nv = chunk_rows(cu, chunk_idx, i_t)
    q += t0 * H * K
    k += t0 * H * K
    G += t0 * HV * K
    beta += t0 * HV
    DP += t0 * HV * 128
    DA = DP + 64
    DQ += t0 * HV * K
    DK += t0 * HV * K
    DQO += t0 * HV * K
    DKO += t0 * HV * K
    DGAM += t0 * HV * K
    DG += t0 * HV * K
    DBK += (i_k.to(tl.int64) * T + t0) * HV
    o = tl.arange(0, 16)
    o_k = i_k * BK + tl.arange(0, BK)
    carry = tl.zeros([BK], dtype=tl.float32)
    # run-time loops (statically unrolled, the kernel compiled 4× longer); the pair loops ``while``
    # because the interpreter cannot take a loop bound that is itself a loop variable
    for i_b in range(4):
        I = 3 - i_b  # row blocks last first
        r_i = I * 16 + o
        m_i = r_i < nv
        b_i = tl.load(beta + r_i * HV + i_hv, mask=m_i, other=0.0)
        g_r = ref_row(G, I * 16, nv, HV, i_hv, o_k, K)
        e_i = after_ref(load_rows(G, r_i, m_i, HV, i_hv, o_k, K), g_r, m_i)
        # earlier column blocks J < I, through block I's reference row r (its first row): the row
        # side here, the column side (rows J's dk) added into DK for block J's turn. Before the
        # diagonal block, so that its four products are not live across this loop.
        acc_q = tl.zeros([16, BK], dtype=tl.float32)
        acc_r = tl.zeros([16, BK], dtype=tl.float32)
        qe_i = load_rows(q, r_i, m_i, H, i_h, o_k, K) * e_i
        keb_i = load_rows(k, r_i, m_i, H, i_h, o_k, K) * e_i * b_i[:, None]
        if SPLIT:
            _col_pairs(I, qe_i, keb_i, G, DP, DA, DK, r_i, m_i, g_r, nv, HV, i_hv, o_k, K, PREC)
            acc_q, acc_r = _row_pairs(acc_q, acc_r, I, k, G, DP, DA, r_i, m_i, g_r, nv, H, HV, i_h, i_hv, o_k, K,
                                      PREC)
        else:
            J = 0
            while J < I:
                r_j = J * 16 + o
                m_j = r_j < nv
                f_j = before_ref(load_rows(G, r_j, m_j, HV, i_hv, o_k, K), g_r)
                dP_ij = _pair_block(DP, r_i, m_i, J * 16, HV, i_hv)
                dA_ij = _pair_block(DA, r_i, m_i, J * 16, HV, i_hv)
                k_j = load_rows(k, r_j, m_j, H, i_h, o_k, K) * f_j
                acc_q += tl.dot(dP_ij, k_j, input_precision=PREC)
                acc_r += tl.dot(dA_ij, k_j, input_precision=PREC)
                dkc_j = (tl.dot(tl.trans(dP_ij), qe_i, input_precision=PREC)
                         + tl.dot(tl.trans(dA_ij), keb_i, input_precision=PREC)) * f_j
                p_j = (r_j[:, None] * HV + i_hv) * K + o_k[None, :]
                tl.store(DK + p_j, tl.load(DK + p_j, mask=m_j[:, None], other=0.0) + dkc_j, mask=m_j[:, None])
                J += 1
        # the diagonal block: rows of block I against columns j ≤ i, dq (through P) and r (through
        # A); columns of block I against rows i ≥ j, dk through P and through A. Through the
        # reference row unless a channel decays by more than SPAN across the block: then pairwise
        # exponents. Its rows, γ and β are read again here rather than kept across the loop.
        q_i = load_rows(q, r_i, m_i, H, i_h, o_k, K)
        k_i = load_rows(k, r_i, m_i, H, i_h, o_k, K)
        g_i = load_rows(G, r_i, m_i, HV, i_hv, o_k, K)
        e_i = after_ref(g_i, g_r, m_i)
        if tl.max(block_span(g_i, g_r, m_i), axis=0) > SPAN:
            b_dq, b_r, b_dkp, b_dka = _diag_pairwise(q_i, k_i, g_i, b_i, m_i, k, G, DP, DA, r_i, I * 16,
                                                     I * 16, nv, H, HV, i_h, i_hv, o_k, K)
            b_dq += acc_q * e_i
            b_r += acc_r * e_i
            b_dkc = b_dkp + b_dka
        else:  # the pair loop's sums accumulated into the diagonal's dots before the row factor
            dP_ii = _pair_block(DP, r_i, m_i, I * 16, HV, i_hv)
            dA_ii = _pair_block(DA, r_i, m_i, I * 16, HV, i_hv)
            f_j = tl.exp(tl.minimum(g_r[None, :] - g_i, SPAN))
            b_dq = tl.dot(dP_ii, k_i * f_j, acc=acc_q, input_precision=PREC) * e_i
            b_r = tl.dot(dA_ii, k_i * f_j, acc=acc_r, input_precision=PREC) * e_i
            b_dkc = tl.dot(tl.trans(dA_ii * b_i[:, None]), k_i * e_i,
                           acc=tl.dot(tl.trans(dP_ii), q_i * e_i, input_precision=PREC), input_precision=PREC) * f_j
        b_rb = b_r * b_i[:, None]
        p_k = (r_i[:, None] * HV + i_hv) * K + o_k[None, :]
        b_dqf = tl.load(DQ + p_k, mask=m_i[:, None], other=0.0) + b_dq
        tl.store(DQO + p_k, b_dqf.to(DQO.dtype.element_ty), mask=m_i[:, None])
        # DK: dqk's and the later blocks' terms; DG: wy_bwd's; DGAM − k ⊙ DK + k ⊙ DG: their dγ
        b_dk0 = tl.load(DK + p_k, mask=m_i[:, None], other=0.0)
        b_dkw = tl.load(DG + p_k, mask=m_i[:, None], other=0.0)
        b_dkf = b_dk0 + b_dkw + b_rb + b_dkc
        tl.store(DKO + p_k, b_dkf.to(DKO.dtype.element_ty), mask=m_i[:, None])
        b_dgam = (tl.load(DGAM + p_k, mask=m_i[:, None], other=0.0) + q_i * b_dq
                  + k_i * (b_dkw - b_dk0 + b_rb - b_dkc))
        tl.store(DG + p_k, tl.cumsum(b_dgam, axis=0, reverse=True) + carry[None, :], mask=m_i[:, None])
        carry += tl.sum(b_dgam, axis=0)
        tl.store(DBK + r_i * HV + i_hv, tl.sum(k_i * b_r, axis=1), mask=m_i)
        tl.debug_barrier()  # block I − 1's rows of DK, written above by other threads, are read next


def backward(q, k, v, G, beta, h0, do, dht, ch: Chunks, scale: float, kkt: tuple | None = None,
             grad_dtype=torch.float32, dv_dtype=None):
    """Gradients of the chunk KDA. Packed, padded shapes: q, k [T, H, K]; v, do [T, HV, V] (one
    dtype); G [T, HV, K] fp32 (the forward's γ); beta [T, HV] fp32; h0, dht [N, HV, K, V] fp32 or
    None; kkt: the forward's (Ai, P), else recomputed. Returns (dq [T, HV, K], dk [T, HV, K],
    dv [T, HV, V], dg [T, HV, K], dbeta [T, HV], dh0 [N, HV, K, V] or None): dq and dk in
    ``grad_dtype``, dv in ``dv_dtype`` (default ``grad_dtype``; each accumulated in fp32 and rounded
    once, by the kernel that finishes it), the rest fp32; dq and dk per value head (the caller sums
    each group, so it asks for fp32 then, while dv needs no sum)."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    prec, DT, io, dev, f32 = dot_precision(v.dtype), tl_dtype(v.dtype), v.dtype, v.device, torch.float32
    fw = forward_intermediates(q, k, v, G, beta, h0, ch, False, scale, kkt)
    Ai, W, h, VN = fw.Ai, fw.W, fw.h, fw.VN
    DVL = torch.empty(T, HV, V, device=dev, dtype=io)
    BV = vtile("dv_local", K, V, io)
    launch(dv_local_kernel, (V // BV, ch.NT, HV), fw.P, do, DVL, ch.cu, ch.chunk_idx, scale, HV, V=V, BV=BV,
           PREC=prec, DT=DT, name="dv_local", io=io)
    dh = torch.empty(ch.NT, HV, K, V, device=dev, dtype=STATE_DTYPE)
    DD = torch.empty(T, HV, V, device=dev, dtype=io)
    dh0 = torch.empty(ch.N, HV, K, V, device=dev, dtype=f32) if h0 is not None else None
    SV = state_vtile("state_bwd", K, V, ch.N * HV, dev, io)
    launch(state_bwd_kernel, (V // SV, ch.N * HV), fw.QG, fw.KT, G, W, do, DVL, dht if dht is not None else v, dh,
           DD, dh0 if dh0 is not None else v, ch.cu, ch.chunk_off, scale, HV, K=K, V=V, BV=SV,
           USE_DHT=dht is not None, USE_INIT=h0 is not None, PREC=prec, DT=DT, WHILE=INTERPRET, name="state_bwd",
           io=io)
    del DVL, fw
    BK, BV = ktile("dqk", K, io), vtile("dqk", K, V, io)
    DQ = torch.empty(T, HV, K, device=dev, dtype=f32)
    DK = torch.empty(T, HV, K, device=dev, dtype=f32)
    DW = torch.empty(T, HV, K, device=dev, dtype=io)
    DGAM = torch.empty(T, HV, K, device=dev, dtype=f32)
    # dP and dA side by side ([T, HV, 128]: dP in columns 0–63, dA in 64–127): intra_bwd reads both
    # blocks of a pair through one address
    DPA = torch.empty(T, HV, 2 * 64, device=dev, dtype=f32)
    launch(dqk_kernel, (K // BK + 1, ch.NT, HV), q, k, G, VN, do, h, dh, DD, DQ, DK, DW, DGAM, DPA, ch.cu, ch.chunk_idx,
           scale, H, HV, K=K, V=V, BK=BK, BV=BV, PREC=prec, name="dqk", io=io)
    del h, dh, VN
    DV = torch.empty(T, HV, V, device=dev, dtype=dv_dtype or grad_dtype)
    DB = torch.empty(T, HV, device=dev, dtype=f32)
    # wy_bwd's dK term goes to DG's storage (its DKW), which intra_bwd reads per row block before
    # it writes dg there
    DG = torch.empty(T, HV, K, device=dev, dtype=f32)
    launch(wy_bwd_kernel, (ch.NT, HV), k, v, G, beta, Ai, DD, DW, DG, DV, DB, DPA, ch.cu, ch.chunk_idx, H, HV,
           K=K, V=V, BK=ktile("wy_bwd", K, io), BV=vtile("wy_bwd", K, V, io), PREC=prec, DT=DT, name="wy_bwd",
           io=io)
    del DD, DW
    BK = ktile("intra_bwd", K, io)
    DBK = torch.empty(K // BK, T, HV, device=dev, dtype=f32)
    # dq and dk are final after intra_bwd, which rounds them once into the outputs' dtype
    DQO, DKO = (DQ, DK) if grad_dtype == f32 else (torch.empty_like(DQ, dtype=grad_dtype),
                                                   torch.empty_like(DK, dtype=grad_dtype))
    # the pair sums take fp32 operands, 3-pass tf32 on the GPU: dP and dA feed dg directly (one-pass
    # tf32 is no faster there: the kernel is not bound by its dots)
    ib = entry("intra_bwd", io)
    launch(intra_bwd_kernel, (K // BK, ch.NT, HV), q, k, G, beta, DPA, DQ, DK, DQO, DKO, DGAM, DG, DBK, ch.cu,
           ch.chunk_idx, T, H, HV, K=K, BK=BK, PREC=ib["PREC"], SPAN=SPAN, SPLIT=ib["PREC"] == "tf32x3",
           name="intra_bwd", io=io)
    return DQO, DKO, DV, DG, DB + DBK.sum(0), dh0
