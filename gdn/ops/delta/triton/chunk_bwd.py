"""Backward kernels of the chunkwise recurrence: the mirror of :mod:`.chunk_fwd`.

With dO the output gradient, dS_out the gradient of the state leaving a chunk (carried from
the next chunk, or the final-state gradient), S the state entering it and δ as in the forward::

    dδ_loc = scale · (Q Kᵀ ⊙ D)ᵀ dO                           dv_local     (parallel)
    dδ     = dδ_loc + K̃ dS_out                                 state pass   (sequential, reverse)
    dS_in  = Γ_C dS_out + scale (ΓQ)ᵀ dO − Wᵀ dδ
    dQ     = scale ((dO δᵀ ⊙ D) K + Γ dO Sᵀ)                    dqk          (parallel)
    dK    += scale (dO δᵀ ⊙ D)ᵀ Q + K̃-term ;  dW = −dδ Sᵀ
    dT     = dδ (βV)ᵀ + dW (βΓK)ᵀ ;  dA = −Tᵀ dT Tᵀ             wy           (parallel)
    dV = β Tᵀ dδ ;  dK, dβ, dγ from W and A ;  dg = reverse cumsum of dγ in the chunk

Without the delta term dδ is dV and the wy stage only turns dγ into dg. On compute capability 9,
for the gated delta members in 16 bits with K ≤ 128, the dqk and wy stages run as one Gluon kernel
per chunk and value head instead (:mod:`.fused_bwd`, ``DELTA["fused_bwd"]``).

As in the forward, intermediates (dδ_loc, dδ, the per-chunk dS, dW) are stored in the input dtype
and every dot takes operands of that dtype (fp32 accumulation); dβ, dγ are fp32; dQ, dK, dV are
accumulated in fp32 and stored once in the dtype the caller asks for.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...triton.common import (BT, INTERPRET, Chunks, cast, chunk_bounds, chunk_rows, dot_precision, gate_cumsum,
                              gate_load, launch, make_segments, make_slices, make_tail_slices,
                              pow2, sm_count, tail_sizes, tl_dtype, value_cols)
from ... import tuning
from ...tuning import DELTA, cdiv
from ...tuning import chunk_tiles as tiles
from .chunk_fwd import _block, forward_intermediates, state_tile, tile_reads
from .split import bounds, chain, fill_empty, split_len, warm_plan, warm_split, warm_up


@triton.jit
def dv_local_kernel(q, k, g, do, DVL, cu, chunk_idx, scale, H, HV, K: tl.constexpr,
                    V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                    PREC: tl.constexpr, DT: tl.constexpr):
    """DVL = scale · (Q Kᵀ ⊙ D)ᵀ dO for one chunk, value head and V tile."""
    i_v, i_t, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_bounds(cu, chunk_idx, i_t, BT)
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    m = rows < eos
    o_v = i_v * BV + tl.arange(0, BV)
    mv = m[:, None] & (o_v < V)[None, :]
    b_pt = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mk = m[:, None] & (o_k < K)[None, :]
        b_q = tl.load(q + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
        b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
        b_pt += tl.dot(b_k, tl.trans(b_q), input_precision=PREC)
    lower = o_t[:, None] <= o_t[None, :]  # [j, i]: key j, query i ≥ j
    if USE_G:
        b_gam, _ = gate_cumsum(g, rows, m, HV, i_hv)
        b_pt = b_pt * tl.exp(tl.where(lower, b_gam[None, :] - b_gam[:, None], float("-inf")))
    else:
        b_pt = tl.where(lower, b_pt, 0.0)
    b_do = tl.load(do + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mv, other=0.0)
    b_dv = scale * tl.dot(b_pt.to(DT), b_do, input_precision=PREC)
    tl.store(DVL + (rows[:, None] * HV + i_hv) * V + o_v[None, :], b_dv.to(DT), mask=mv)


@triton.jit
def _state_bwd_step(j, b_ds, NC, q, k, g, W, do, DVL, dh, DD, bos, eos, c0, i_hv, i_h, o_t, o_k, o_v, mkv, p_s,
                    scale, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                    USE_G: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                    AUG: tl.constexpr, QS: tl.constexpr, TMA: tl.constexpr = False, v0=0, keep=True,
                    FROM_INV: tl.constexpr = False, beta=None):
    """Step j of the reverse pass (chunk NC − 1 − j): store dS_out, compute dδ, return dS_in (``keep``
    false: store nothing, a warm-up chunk of ``state_bwd_kernel``'s ``WARM`` form). With
    ``AUG`` the first K columns read zero dO and dδ_loc and nothing is stored (see the kernel).
    ``TMA`` (not with ``AUG``): q, k, do, DVL and W are tensor descriptors (``_block``; ``v0``
    the value tile's first column), and dO and dδ are zeroed on the rows of a later sequence.
    ``FROM_INV`` (delta members): ``W`` holds the in-chunk inverse T [T, HV, BT] instead, and the
    Wᵀ dδ term is formed from it as Kᵀ diag(βΓ) (Tᵀ dδ), since W = T diag(βΓ) K."""
    i_c = NC - 1 - j
    b_dsd = b_ds.to(DT)
    if not AUG:
        tl.store(dh + ((c0 + i_c) * HV + i_hv) * K * V + p_s, b_dsd, mask=mkv & (i_c >= 0) & keep)
    rows = bos + i_c * BT + o_t
    m = (rows >= bos) & (rows < eos)
    mk = m[:, None] & (o_k < K)[None, :]
    o_u, mv = value_cols(o_v, m, K, V, AUG)
    # Q and K feed the dots as loaded: the row scales of K̃ = diag(exp(γ_C − γ)) K and of
    # scale·diag(Γ) Q go on the [BT, BV] products and dO instead of the [BT, K] tiles
    row0 = bos + i_c * BT
    if TMA:  # a later sequence's rows: no dO, and (below) no dδ, so they add nothing to dS
        b_q = _block(q, row0, i_h * K)
        b_k = _block(k, row0, i_h * K)
        b_do = _block(do, row0, i_hv * V + v0)
        b_do = tl.where(m[:, None], b_do, tl.zeros_like(b_do))
    else:
        b_q = tl.load(q + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
        b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
        b_do = tl.load(do + (rows[:, None] * HV + i_hv) * V + o_u[None, :], mask=mv, other=0.0)
    if not QS:
        b_do = b_do.to(tl.float32)
    if TMA:
        b_dd = _block(DVL, row0, i_hv * V + v0).to(tl.float32)
    else:
        b_dd = tl.load(DVL + (rows[:, None] * HV + i_hv) * V + o_u[None, :], mask=mv, other=0.0).to(tl.float32)
    b_kds = tl.dot(b_k, b_dsd, input_precision=PREC)
    # the row scale scale·Γ of the (ΓQ)ᵀ dO term goes on dO, or with QS on Q (see state_bwd_kernel)
    if USE_G:  # g holds the in-chunk cumulative decay γ here (chunk_cumsum)
        cs = bos + i_c * BT
        b_gam, b_gc = gate_load(g, rows, m, HV, i_hv, tl.minimum(eos, cs + BT) - 1, i_c >= 0)
        b_kds = b_kds * tl.exp(b_gc - b_gam)[:, None]
        if QS:
            b_q = (b_q.to(tl.float32) * (scale * tl.exp(b_gam))[:, None]).to(DT)
        else:
            b_do = b_do * (scale * tl.exp(b_gam))[:, None]
    elif QS:
        b_q = (b_q.to(tl.float32) * scale).to(DT)
    else:
        b_do = b_do * scale
    b_dd += b_kds
    if TMA:
        b_dd = tl.where(m[:, None], b_dd, tl.zeros_like(b_dd))
    b_ddd = b_dd.to(DT)
    if not AUG:
        tl.store(DD + (rows[:, None] * HV + i_hv) * V + o_u[None, :], b_ddd, mask=mv & keep)
    if USE_G:
        b_ds = b_ds * tl.exp(b_gc)
    b_ds += tl.dot(tl.trans(b_q), b_do.to(DT), input_precision=PREC)
    if DELTA:
        if FROM_INV:
            # Wᵀ dδ = Kᵀ (diag(βΓ) Tᵀ dδ): Tᵀ dδ accumulates in fp32, takes the row scale and is
            # rounded to DT once (the stored path rounds W instead); rows past the end have β = 0
            if TMA:
                b_a = _block(W, row0, i_hv * BT)
            else:
                b_a = tl.load(W + (rows[:, None] * HV + i_hv) * BT + o_t[None, :], mask=m[:, None], other=0.0)
            b_y = tl.dot(tl.trans(b_a), b_ddd, input_precision=PREC)
            b_bg = tl.load(beta + rows * HV + i_hv, mask=m, other=0.0).to(tl.float32)
            if USE_G:
                b_bg = b_bg * tl.exp(b_gam)
            b_ds -= tl.dot(tl.trans(b_k), (b_y * b_bg[:, None]).to(DT), input_precision=PREC)
        else:
            if TMA:
                b_w = _block(W, row0, i_hv * K)
            else:
                b_w = tl.load(W + (rows[:, None] * HV + i_hv) * K + o_k[None, :], mask=mk, other=0.0)
            b_ds -= tl.dot(tl.trans(b_w), b_ddd, input_precision=PREC)
    return b_ds


@triton.jit
def state_bwd_kernel(q, k, g, W, do, DVL, dht, dh, DD, dh0, cu, ends, chunk_off, scale, H,
                     HV, beta, seg_seq, seq_cu, seq_off, Bnd, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, DELTA: tl.constexpr,
                     USE_DHT: tl.constexpr, USE_INIT: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                     WHILE: tl.constexpr,
                     AUG: tl.constexpr = False, QS: tl.constexpr = False, TMA: tl.constexpr = False,
                     WARM: tl.constexpr = False, LOG_EPS: tl.constexpr = -16.0, FROM_INV: tl.constexpr = False,
                     CARRY: tl.constexpr = False):
    """Reverse pass over one sequence's chunks: dh[c] = dS_out of chunk c, DD = dδ, dh0 = dS_0.
    Runs the sequence's own chunk count of steps, last chunk first, like the forward pass. Program
    n takes tokens [cu[n], ends[n]) (``ends`` is ``cu[1:]`` but for a slice of the sequences,
    :func:`gdn.ops.triton.common.make_slices`) and its chunks' dS_out go to dh from chunk_off[n] on.
    ``FROM_INV`` (delta members): ``W`` is the in-chunk inverse T and ``beta`` is read; the pass
    forms Wᵀ dδ from them (``_state_bwd_step``), so the backward needs neither W nor U.

    ``AUG`` (first phase of the split pass): the "sequences" are segments, dS is K × (K + V) and
    starts as [I | 0], the first K columns see zero dO and dδ_loc, nothing per chunk is stored, and
    [Aᵀ | D] goes to ``dh0`` [N, HV, K, K + V]: the segment maps dS at its end to Aᵀ dS + D at its start.

    ``QS`` (a form of ``DELTA["state_bwd"]["stages"]``'s candidates, chosen per launch by
    :func:`gdn.ops.triton.launch.by_waves`): the row scale scale·Γ of the (ΓQ)ᵀ dO term goes on Q instead of dO.
    Compiled for sm_90 (`tools/sass_cpu.py`) that takes the kernel's shared memory from 116.5
    to 112.5 KB at value tiles of 32 (Q single-buffered, dO's staging copy gone): two programs per
    multiprocessor instead of one at two stages, at the price of scaling a [64, K] tile per step.
    Measured on the H200 (GPU µs): (4, 8192, 16, 128) 568 → 446 (one wave instead
    of two); where it saves no wave it is slower (1 × 32768, three stages: 714 → 948).

    ``WARM`` (gated members): the warm-started split, the reverse of ``state_fwd_kernel``'s: the
    "sequences" are segments of sequence ``seg_seq[s]`` (tokens bounded by ``seq_cu``); a segment's
    program walks forward over the chunks after it, adding up their log norm bounds (Bnd [NT, HV],
    split.bounds), until the sum falls to ``LOG_EPS`` or the sequence ends, runs those chunks in reverse from
    a zero dS (from dht at the sequence end) storing nothing, then its own; the first segment of a
    sequence stores dS_0. With ``CARRY`` every program stores the dS entering its range at its own
    index of dh0 instead (a sliced warm-started pass: the later slices start from it)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(ends + i_n).to(tl.int64)
    c0 = tl.load(chunk_off + i_n).to(tl.int64)
    NC = tl.cdiv(eos - bos, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    NV: tl.constexpr = K + V if AUG else V
    mkv = (o_k < K)[:, None] & (o_v < NV)[None, :]
    p_s = o_k[:, None] * V + o_v[None, :]
    i_seq = i_n
    at_end = True
    first = True
    nw = 0
    if WARM:
        i_seq, sbos, seos, nw = warm_up(Bnd, g, seg_seq, seq_cu, seq_off, i_n, bos, eos, i_hv, HV, BT, DELTA,
                                        LOG_EPS, True)
        first = bos == sbos
        eos = tl.minimum(eos + nw * BT, seos)
        at_end = eos == seos
        NC = tl.cdiv(eos - bos, BT)
    b_ds = tl.zeros([BK, BV], dtype=tl.float32)
    if AUG:
        b_ds = (o_k[:, None] == o_v[None, :]).to(tl.float32)
    elif USE_DHT:
        b_ds = tl.load(dht + (i_seq * HV + i_hv).to(tl.int64) * K * V + p_s, mask=mkv & at_end, other=0.0).to(
            tl.float32)
    if WHILE:
        j = 0
        while j < NC:
            b_ds = _state_bwd_step(j, b_ds, NC, q, k, g, W, do, DVL, dh, DD, bos, eos, c0, i_hv, i_h, o_t, o_k, o_v, mkv,
                                   p_s, scale, H, HV, K, V, BT, USE_G, DELTA, PREC, DT, AUG, QS, TMA, i_v * BV,
                                   j >= nw, FROM_INV, beta)
            j += 1
    else:
        for j in range(0, NC):
            b_ds = _state_bwd_step(j, b_ds, NC, q, k, g, W, do, DVL, dh, DD, bos, eos, c0, i_hv, i_h, o_t, o_k, o_v, mkv,
                                   p_s, scale, H, HV, K, V, BT, USE_G, DELTA, PREC, DT, AUG, QS, TMA, i_v * BV,
                                   j >= nw, FROM_INV, beta)
    if USE_INIT:
        i_0 = i_seq
        if CARRY:
            i_0 = i_n
            first = True
        tl.store(dh0 + (i_0 * HV + i_hv).to(tl.int64) * K * NV + o_k[:, None] * NV + o_v[None, :], b_ds,
                 mask=mkv & first)


@triton.jit(do_not_specialize=['T'])
def dqk_kernel(q, k, v, g, VN, do, h, dh, DD, DQ, DK, DW, DGAM, cu, chunk_idx, srows, scale, T, H,
               HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, USE_G: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
               TMA: tl.constexpr = False):
    """dQ, the O- and state-terms of dK, dW = −dδ Sᵀ and this K tile's part of dγ, per chunk i_t of
    ``chunk_idx`` (all of the call's chunks or a slice of them): its state entering from h at row
    srows[i_t, 0], the gradient of the one leaving from dh at row srows[i_t, 1] (common.Slice).
    ``TMA``: δ (or v), dO, dδ, h and dh are tensor descriptors (``_block``; the per-chunk states
    as [chunks · HV · K, V] rows), their value tiles read by bulk copies instead of through a
    pointer and a mask per thread and element. A block's rows of a later sequence are read as
    they are and add nothing: in dO δᵀ ⊙ D the causal mask drops a later row of δ against an
    earlier row of dO, and a later row of dO meets only rows of q (zero there) or rows of dQ and
    dW that are not stored; zeroing them costs the tiles a trip through registers (ptxas, sm_90,
    (4, 8192): 320 / 328 B of spills with it, 64 / 64 without, 108 / 108 with per-thread loads)."""
    i_k, i_t, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_bounds(cu, chunk_idx, i_t, BT)
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    m = rows < eos
    o_k = i_k * BK + tl.arange(0, BK)
    mk = m[:, None] & (o_k < K)[None, :]
    i_g = tl.load(srows + 2 * i_t)  # the chunk's row in h
    i_d = tl.load(srows + 2 * i_t + 1)  # and in dh
    base_h = (i_g.to(tl.int64) * HV + i_hv) * K * V
    base_dh = (i_d.to(tl.int64) * HV + i_hv) * K * V
    b_dod = tl.zeros([BT, BT], dtype=tl.float32)
    b_dqs = tl.zeros([BT, BK], dtype=tl.float32)
    b_dks = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_gcs = tl.zeros([BK], dtype=tl.float32)
    # the state tiles' first rows in the [chunks · HV · K, V] views
    row_h = (i_g * HV + i_hv) * K + i_k * BK
    row_dh = (i_d * HV + i_hv) * K + i_k * BK
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mv = m[:, None] & (o_v < V)[None, :]
        mkv = (o_k < K)[:, None] & (o_v < V)[None, :]
        if TMA:
            v0 = i_hv * 0 + i_v * BV  # (a tensor under the interpreter too, as _block takes)
            b_d = _block(VN if DELTA else v, t0, i_hv * V + v0)
            b_do = _block(do, t0, i_hv * V + v0)
            b_s = _block(h, row_h, v0)
            b_ds = _block(dh, row_dh, v0)
        else:
            if DELTA:
                b_d = tl.load(VN + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mv, other=0.0)
            else:
                b_d = tl.load(v + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mv, other=0.0)
            b_do = tl.load(do + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mv, other=0.0)
            b_s = tl.load(h + base_h + o_k[:, None] * V + o_v[None, :], mask=mkv, other=0.0)
            b_ds = tl.load(dh + base_dh + o_k[:, None] * V + o_v[None, :], mask=mkv, other=0.0)
        b_dod += tl.dot(b_do, tl.trans(b_d), input_precision=PREC)
        b_dqs += tl.dot(b_do, tl.trans(b_s), input_precision=PREC)
        b_dks += tl.dot(b_d, tl.trans(b_ds), input_precision=PREC)
        if DELTA:
            if TMA:
                b_dd = _block(DD, t0, i_hv * V + v0)
            else:
                b_dd = tl.load(DD + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=mv, other=0.0)
            b_dw -= tl.dot(b_dd, tl.trans(b_s), input_precision=PREC)
        if USE_G:
            b_gcs += tl.sum(b_s.to(tl.float32) * b_ds.to(tl.float32), axis=1)
    b_q = tl.load(q + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
    b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
    lower = o_t[:, None] >= o_t[None, :]
    if USE_G:
        b_gam, b_gc = gate_cumsum(g, rows, m, HV, i_hv)
        b_dm = tl.exp(tl.where(lower, b_gam[:, None] - b_gam[None, :], float("-inf")))
        b_dsm = b_dod * b_dm * scale
        b_dqs = b_dqs * (scale * tl.exp(b_gam))[:, None]
        b_dks = b_dks * tl.exp(b_gc - b_gam)[:, None]
    else:
        b_dsm = tl.where(lower, b_dod * scale, 0.0)
        b_dqs = b_dqs * scale
    b_qf = b_q.to(tl.float32)
    b_kf = b_k.to(tl.float32)
    b_dq = tl.dot(b_dsm.to(DT), b_k, input_precision=PREC) + b_dqs
    b_dk = tl.dot(tl.trans(b_dsm.to(DT)), b_q, input_precision=PREC) + b_dks
    p_out = (rows[:, None] * HV + i_hv) * K + o_k[None, :]
    tl.store(DQ + p_out, b_dq.to(DQ.dtype.element_ty), mask=mk)
    tl.store(DK + p_out, b_dk.to(DK.dtype.element_ty), mask=mk)
    if DELTA:
        tl.store(DW + p_out, b_dw.to(DT), mask=mk)
    if USE_G:
        b_e = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * b_dsm
        b_a = tl.sum(b_kf * b_dks, axis=1)
        b_dg = tl.sum(b_e, axis=1) - tl.sum(b_e, axis=0) + tl.sum(b_qf * b_dqs, axis=1) - b_a
        # γ_C is γ at the chunk's last valid row (g is 0 past the sequence end).
        b_last = tl.sum(b_a, axis=0) + tl.exp(b_gc) * tl.sum(b_gcs, axis=0)
        b_dg += tl.where(rows == tl.minimum(eos, t0 + BT) - 1, b_last, 0.0)
        tl.store(DGAM + (i_k * T + rows) * HV + i_hv, b_dg, mask=m)


@triton.jit(do_not_specialize=['T'])
def wy_bwd_kernel(k, v, g, beta, Ai, DD, DW, DK, DKO, DV, DB, DGAM, DG, cu, chunk_idx, T, H,
                  HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, NK: tl.constexpr, USE_G: tl.constexpr, DELTA: tl.constexpr,
                  PREC: tl.constexpr, DT: tl.constexpr):
    """Gradients through W = T diag(βΓ) K, U = T diag(β) V and T = (I + A)⁻¹; then dg."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, t0, eos = chunk_bounds(cu, chunk_idx, i_t, BT)
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    m = rows < eos
    b_dgam = tl.zeros([BT], dtype=tl.float32)
    if USE_G:
        b_gam, _ = gate_cumsum(g, rows, m, HV, i_hv)
        for i in range(0, NK):
            b_dgam += tl.load(DGAM + (i * T + rows) * HV + i_hv, mask=m, other=0.0)
    if DELTA:
        b_b = tl.load(beta + rows * HV + i_hv, mask=m, other=0.0).to(tl.float32)
        b_G = tl.full([BT], 1.0, dtype=tl.float32)
        if USE_G:
            b_G = tl.exp(b_gam)
        b_bg = b_b * b_G
        b_A = tl.load(Ai + (rows[:, None] * HV + i_hv) * BT + o_t[None, :], mask=m[:, None], other=0.0)
        b_dT = tl.zeros([BT, BT], dtype=tl.float32)
        b_kk = tl.zeros([BT, BT], dtype=tl.float32)
        b_db = tl.zeros([BT], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            mv = m[:, None] & (o_v < V)[None, :]
            p_v = (rows[:, None] * HV + i_hv) * V + o_v[None, :]
            b_du = tl.load(DD + p_v, mask=mv, other=0.0)
            b_v = tl.load(v + p_v, mask=mv, other=0.0).to(tl.float32)
            b_dT += tl.dot(b_du, tl.trans((b_v * b_b[:, None]).to(DT)), input_precision=PREC)
            b_tdu = tl.dot(tl.trans(b_A), b_du, input_precision=PREC)
            tl.store(DV + p_v, (b_tdu * b_b[:, None]).to(DV.dtype.element_ty), mask=mv)
            b_db += tl.sum(b_v * b_tdu, axis=1)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            mk = m[:, None] & (o_k < K)[None, :]
            p_k = (rows[:, None] * HV + i_hv) * K + o_k[None, :]
            b_dw = tl.load(DW + p_k, mask=mk, other=0.0)
            b_kr = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
            b_k = b_kr.to(tl.float32)
            b_kb = b_k * b_bg[:, None]
            b_dT += tl.dot(b_dw, tl.trans(b_kb.to(DT)), input_precision=PREC)
            b_tdw = tl.dot(tl.trans(b_A), b_dw, input_precision=PREC)
            b_db += tl.sum(b_k * b_tdw, axis=1) * b_G
            if USE_G:
                b_dgam += tl.sum(b_kb * b_tdw, axis=1)
            b_kk += tl.dot(b_kr, tl.trans(b_kr), input_precision=PREC)
        # dA = −Tᵀ dT Tᵀ on fp32 operands (tf32 for half inputs): it feeds dβ and dγ directly.
        b_Af = b_A.to(tl.float32)
        b_dA = -tl.dot(tl.dot(tl.trans(b_Af), b_dT, input_precision=PREC), tl.trans(b_Af), input_precision=PREC)
        strict = o_t[:, None] > o_t[None, :]
        if USE_G:
            b_dec = tl.exp(tl.where(strict, b_gam[:, None] - b_gam[None, :], float("-inf")))
        else:
            b_dec = tl.where(strict, 1.0, 0.0)
        b_dA = tl.where(strict, b_dA, 0.0) * b_dec
        b_db += tl.sum(b_dA * b_kk, axis=1)
        b_mf = b_dA * b_b[:, None]
        if USE_G:
            b_e = b_mf * b_kk
            b_dgam += tl.sum(b_e, axis=1) - tl.sum(b_e, axis=0)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            mk = m[:, None] & (o_k < K)[None, :]
            p_k = (rows[:, None] * HV + i_hv) * K + o_k[None, :]
            # dK = (dqk's terms) + diag(βΓ) Tᵀ dW + (M + Mᵀ) K with M = dA ⊙ β: Tᵀ dW is recomputed
            # here from dW (half the bytes of a stored fp32 term), and dK is read and written once
            b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mk, other=0.0)
            b_dw = tl.load(DW + p_k, mask=mk, other=0.0)
            b_add = tl.dot((b_mf + tl.trans(b_mf)).to(DT), b_k, input_precision=PREC)
            b_add += tl.dot(tl.trans(b_A), b_dw, input_precision=PREC) * b_bg[:, None]
            tl.store(DKO + p_k, (tl.load(DK + p_k, mask=mk, other=0.0) + b_add).to(DKO.dtype.element_ty), mask=mk)
        tl.store(DB + rows * HV + i_hv, b_db, mask=m)
    if USE_G:
        b_dg = tl.cumsum(b_dgam, axis=0, reverse=True)
        tl.store(DG + rows * HV + i_hv, b_dg, mask=m)


def _reverse_pass(q, g, beta, ch: Chunks, HV: int, K: int, V: int, from_inv: bool, tiles: int):
    """(the fused_rev module or None, segment length L or 0) of a backward's reverse pass: the
    warp-specialised pass (delta.triton.fused_rev: dv_local's work inside, one program per sequence
    or warm-started segment, value head and value tile, at most one a multiprocessor: its shared
    memory takes one whole) where it takes the call and the split, if any, is warm-started; else
    None (dv_local, then state_bwd in ``tiles`` value tiles a head). Either runs sliced where dh
    would pass the budget (:func:`backward`)."""
    dev, warm = q.device, warm_split(g)
    rev = _fused_rev() if from_inv else None
    if rev is not None and rev.usable(q, g, beta, K, V):
        L = split_len(ch, HV, rev.value_tiles(V), dev, warm, per_sm=1)
        if not L or warm:
            return rev, L
    return None, split_len(ch, HV, tiles, dev, warm)


def _decisions(q, g, beta, ch: Chunks, HV: int, K: int, V: int, from_inv: bool, size: int) -> tuple:
    """((SK, SV) of state_bwd, the warm split's value tile WV, the reverse pass module or None, its
    segment length L, the number of slices) of a backward (inputs of ``size`` bytes an element),
    worked out once per chunk layout, shapes, dtype, device, launch tables (tuning.token) and the
    device rules' answers (whether the warp-specialised reverse pass could take the call, the
    multiprocessors: asked at every call) and kept in the layout's memo, as the forward's
    (delta.triton.chunk._decisions)."""
    rev = _fused_rev() if from_inv else None
    usable = rev is not None and rev.usable(q, g, beta, K, V)
    key = ("bwd decisions", HV, K, V, q.dtype, q.device, g is None, beta is None, from_inv, size, usable,
           sm_count(q.device), tuning.token())
    hit = ch.memo.get(key)
    if hit is None:
        st = state_tile("state_bwd", ch, HV, K, V, q.device)
        # the warm-started split's value tile: at most 32 (ptxas, sm_90, K = 128: 64-wide tiles of the
        # reverse pass spill 168–512 B at every depth, 32-wide ones none); its segments fill the card
        WV = min(tiles("state_bwd", K, V)[1], 32)
        budget = DELTA["state_bwd"]["slice_MB"] * 2 ** 20
        dh_bytes = ch.NT * HV * K * V * size  # dS_out of every chunk
        rev, L = _reverse_pass(q, g, beta, ch, HV, K, V, from_inv, cdiv(V, WV if warm_split(g) else st[1]))
        # the number of slices of the plain or warm-started reverse pass (below; the chained split
        # is not sliced)
        nsl = 1 if not budget or (L and not warm_split(g)) else max(1, min(
            L or ch.max_nc, DELTA["state_bwd"]["max_slices"], cdiv(dh_bytes, max(1, int(budget)))))
        hit = ch.memo[key] = (st, WV, rev, L, nsl)
    return hit


def _state_bwd_reverse(args, kw, dh, DD, dummy, scale: float, dS_end, dS_0, starts, ends, off, **more):
    """One launch of state_bwd_kernel (grid and per-chunk inputs ``args``, keywords ``kw`` and
    ``more``) over token ranges [starts, ends), from dS_end (or zero) to dS_0 (when given)."""
    launch(state_bwd_kernel, *args, dS_end if dS_end is not None else dummy, dh, DD,
           dS_0 if dS_0 is not None else dummy, starts, ends, off, scale, USE_DHT=dS_end is not None,
           USE_INIT=dS_0 is not None, **kw, **more)


@functools.cache  # (an import statement costs a lookup through the import system at each call)
def _fused_rev():
    """The Gluon reverse pass's module (delta.triton.fused_rev), imported on first use; None where
    this triton has no Gluon."""
    try:
        from . import fused_rev  # noqa: PLC0415
    except ImportError:
        return None
    return fused_rev


@functools.cache  # (an import statement costs a lookup through the import system at each call)
def _fused_bwd():
    """The Gluon fused backward's module (delta.triton.fused_bwd), imported on first use; None where
    this triton has no Gluon."""
    try:
        from . import fused_bwd  # noqa: PLC0415
    except ImportError:
        return None
    return fused_bwd


@functools.cache  # (an import statement costs a lookup through the import system at each call)
def _fused_rbwd():
    """The Gluon merged backward's module (delta.triton.fused_rbwd), imported on first use; None
    where this triton has no Gluon."""
    try:
        from . import fused_rbwd  # noqa: PLC0415
    except ImportError:
        return None
    return fused_rbwd


def backward(q, k, v, g, beta, h0, do, dht, ch: Chunks, scale: float, Ai=None, grad_dtype=torch.float32,
             gamma=None, dv_dtype=None, plans=None):
    """Gradients of the chunk op. Shapes in the packed layout: q, k [T, H, K]; v, do [T, HV, V]
    (q, k, v, do of one dtype); g, beta [T, HV] fp32 or None; h0, dht [N, HV, K, V] fp32 or None;
    ``Ai`` the forward's in-chunk inverse and ``gamma`` its γ (each recomputed when None), ``plans``
    its chunk bounds and warm-up counts (chunk_fwd.forward's; made here when missing).
    Returns (dq [T, HV, K], dk [T, HV, K], dv [T, HV, V], dg or None, dbeta or None, dh0 or None):
    dq and dk in ``grad_dtype``, dv in ``dv_dtype`` (default ``grad_dtype``; each accumulated in
    fp32 and rounded once; dv of the members without the delta term is dδ, in the input dtype), the
    rest fp32; dq and dk are per value head (the caller sums each group, so it asks for fp32 then,
    while dv needs no sum and may come in the input dtype)."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    delta, gated = beta is not None, g is not None
    prec, DT, io = dot_precision(v.dtype), tl_dtype(v.dtype), v.dtype
    dev, f32 = v.device, torch.float32
    # from_inverse: the recomputed state pass and the reverse pass form δ and Wᵀ dδ from T⁻¹ (no wu)
    from_inv = delta and bool(DELTA["state_bwd"]["from_inverse"])
    plans = {} if plans is None else plans
    (SK, SV), WV, rev, L, nsl = _decisions(q, g, beta, ch, HV, K, V, from_inv, v.element_size())
    warm = bool(L) and warm_split(g)
    rb = _fused_rbwd() if rev is not None else None  # (rev: a delta member from T⁻¹, unsplit or warm-started)
    merged = rb is not None and rb.usable(q, g, beta, K, V)
    # the sliced pass with its dS_out in h's buffer (DELTA["state_bwd"]["share_h"]): slices cut from
    # each sequence's (or warm-started segment's) end, the first of the budget's size, h padded by
    # it after each sequence (segment); the segments' pads only where the recomputed state pass runs
    # the same segments (else h comes without pads, and the slices take a buffer of their own)
    sizes, pad_L = None, 0
    if nsl > 1 and (warm or not L) and not merged and DELTA["state_bwd"]["share_h"]:
        span = L if warm else ch.max_nc
        sizes, pad_L = tuple(tail_sizes(span, cdiv(span, nsl))), (L if warm else 0)
    h, VN, _, Ai, W, gamma = forward_intermediates(q, k, v, g, beta, h0, ch, False, Ai, from_inverse=from_inv,
                                                   gamma=gamma, plans=plans, pad=sizes[0] if sizes else 0,
                                                   pad_L=pad_L)
    if h.shape[0] == ch.NT:
        sizes = None
    dummy = v
    gp = g if gated else dummy
    # the chunks' log norm bounds that the warm-started split's walks add up (the forward's, in plans)
    bnd = bounds(k, beta, gamma, ch, HV, plans) if warm else None
    if merged:
        return _merged(rb, q, k, v, do, gamma, beta, Ai, VN, h, h0, dht, ch, scale, L if warm else 0, bnd,
                       grad_dtype, dv_dtype)
    common = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=SK, USE_G=gated, DELTA=delta, PREC=prec, DT=DT, WHILE=INTERPRET,
                  beta=beta if delta else dummy, seg_seq=ch.cu, seq_cu=ch.cu, seq_off=ch.chunk_off,
                  Bnd=bnd if bnd is not None else dummy, FROM_INV=from_inv, name="state_bwd")
    Wp = (Ai if from_inv else W) if delta else dummy
    del W
    gs = gamma if gated else dummy  # the state pass reads γ, not g
    DVL = torch.empty(T, HV, V, device=dev, dtype=io)  # dδ_loc (then dδ over it); dδ alone for fused_rev
    if rev is None:
        BK, BV = tiles("dv_local", K, V)
        launch(dv_local_kernel, (cdiv(V, BV), ch.NT, HV),
               q, k, gp, do, DVL, ch.cu, ch.chunk_idx, scale, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV,
               USE_G=gated, PREC=prec, DT=DT, name="dv_local")
    # dδ is written over dδ_loc (each program reads a chunk's rows before it writes them, and no
    # other program's), except by the warm-started split, whose warm-up reads the next segment's rows
    DD = torch.empty(T, HV, V, device=dev, dtype=io) if warm and rev is None else DVL
    # Sliced reverse pass (where dS_out of every chunk would take more than
    # DELTA["state_bwd"]["slice_MB"]; in at most max_slices slices): the chunk positions are cut into
    # slices, run last first, each the reverse pass over its chunks (from the dS carried out of the
    # slice after it) and then the per-chunk kernels over them, so that dh holds one slice's chunks
    # instead of all. The plain pass slices every sequence's chunks; the warm-started split slices
    # every segment's, counted from its end: its first slice warms each segment up once and carries
    # the dS entering the slice out, the later ones go on from it (no warm-up walked again).
    slices = None
    if sizes:
        slices = make_tail_slices(ch, sizes, dev, pad_L)
    elif nsl > 1 and warm:
        S = cdiv(L, nsl)
        slices = make_tail_slices(ch, (S,) * cdiv(L, S), dev, L, shared=False)
    elif nsl > 1:
        slices = make_slices(ch, cdiv(ch.max_nc, nsl), dev)
    dh = h if sizes else torch.empty(max(sl.NT for sl in slices) if slices else ch.NT, HV, K, V, device=dev, dtype=io)
    dh0 = torch.empty(ch.N, HV, K, V, device=dev, dtype=f32) if h0 is not None and not slices else None
    per_chunk = _per_chunk(q, k, v, g, beta, Ai, VN, do, h, dh, DD, gamma, ch, scale, grad_dtype, dv_dtype)
    del h, VN
    if warm and slices:
        sg = make_segments(ch, L, dev)
        carry = torch.empty(sg.NS, HV, K, V, device=dev, dtype=f32)  # dS entering each segment's slice
        if rev is not None:
            run = rev.reverser(q, k, do, gs, beta, Ai, dh, DD, scale)
            plan = (warm_plan(bnd, gs, sg, ch, HV, after=True), sg.seq, ch.cu)
        else:
            run = functools.partial(_state_bwd_reverse, ((cdiv(V, WV), sg.NS * HV), q, k, gs, Wp, do, DVL),
                                    dict(common, BV=WV, seg_seq=sg.seq), dh, DD, dummy, scale)
            warm_kw = dict(WARM=True, CARRY=True, LOG_EPS=float(DELTA["split"]["log_eps"]))
        for j, sl in enumerate(slices):
            last = j == len(slices) - 1
            keep = carry if not last or h0 is not None else None
            d_end = dht if j == 0 else carry
            if rev is not None:
                run(d_end, keep, sl.starts, sl.ends, sl.off, sg.NS, warm=plan if j == 0 else None, carry=j == 0)
            else:
                run(d_end, keep, sl.starts, sl.ends, sl.off, **(warm_kw if j == 0 else {}))
            outs = per_chunk(sl.chunk_idx, sl.rows, sl.NT, last)
        if h0 is not None:  # dS_0 of a sequence: the dS entering its first segment
            dh0 = torch.index_select(carry, 0, sg.first.clamp(max=max(sg.NS - 1, 0)))
        fill_empty(dh0, dht, ch)
    elif warm:
        # Warm-started split reverse pass (fused_rev's or state_bwd_kernel's WARM form), as in the forward
        sg = make_segments(ch, L, dev)
        if rev is not None:
            rev.reverse(q, k, do, gs, beta, Ai, dht, dh, DD, dh0, sg.cu, sg.cu[1:], sg.off, sg.NS, scale,
                        warm=(warm_plan(bnd, gs, sg, ch, HV, after=True), sg.seq, ch.cu))
        else:
            SV = WV
            launch(state_bwd_kernel, (cdiv(V, SV), sg.NS * HV), q, k, gs, Wp, do, DVL,
                   dht if dht is not None else dummy, dh, DD, dh0 if dh0 is not None else dummy, sg.cu, sg.cu[1:],
                   sg.off, scale, BV=SV, USE_DHT=dht is not None, USE_INIT=h0 is not None, WARM=True,
                   LOG_EPS=float(DELTA["split"]["log_eps"]), **dict(common, seg_seq=sg.seq))
        fill_empty(dh0, dht, ch)
    elif L:
        # Split reverse pass, as in the forward: (1) each segment's map dS_end ↦ Aᵀ dS_end + D from
        # [I | 0]; (2) chain the maps from each sequence's end; (3) each segment from its true dS_end.
        sg = make_segments(ch, L, dev)
        X = torch.empty(sg.NS, HV, K, K + V, device=dev, dtype=f32)
        AV = min(pow2(K + V), max(16, DELTA["state_aug"]["SV"] // SK))
        launch(state_bwd_kernel, (cdiv(K + V, AV), sg.NS * HV), q, k, gs, Wp, do, DVL, dummy, dummy,
               dummy, X, sg.cu, sg.cu[1:], sg.off, scale, BV=AV, USE_DHT=False, USE_INIT=True, AUG=True,
               **dict(common, name="state_aug"))
        Send = chain(X, dht, dh0, sg, HV, K, V, True, prec)
        launch(state_bwd_kernel, (cdiv(V, SV), sg.NS * HV), q, k, gs, Wp, do, DVL, Send, dh, DD, dummy,
               sg.cu, sg.cu[1:], sg.off, scale, BV=SV, USE_DHT=True, USE_INIT=False, **common)
    else:
        if rev is not None:
            # reverse(dS_end, dS_0, starts, ends, off): one launch over token ranges [starts, ends),
            # from dS_end (or zero) to dS_0 (when given); its descriptors made once for every slice
            reverse = functools.partial(rev.reverser(q, k, do, gs, beta, Ai, dh, DD, scale,
                                                     rev.plain_tile(V, ch.N * HV, dev)), N=ch.N)
        else:
            # the per-chunk inputs, perhaps as tensor descriptors
            wr = ((Ai, BT) if from_inv else (Wp, K)) if delta else (k, K)
            tma, (qa, ka, da, la, wa) = tile_reads("state_bwd", (q, K), (k, K), (do, SV), (DVL, SV), wr)
            reverse = functools.partial(_state_bwd_reverse, ((cdiv(V, SV), ch.N * HV), qa, ka, gs, wa, da, la),
                                        dict(BV=SV, TMA=tma, **common), dh, DD, dummy, scale)
            del qa, ka, da, la, wa, wr
        if slices:
            # dS carried between slices in place: a program reads its tile of it first and writes it last
            carry = torch.empty(ch.N, HV, K, V, device=dev, dtype=f32)
            if dht is not None:
                carry.copy_(dht)
            for j, sl in enumerate(slices):
                last = j == len(slices) - 1
                reverse(carry if j > 0 or dht is not None else None, carry if not last or h0 is not None else None,
                        sl.starts, sl.ends, sl.off)
                outs = per_chunk(sl.chunk_idx, sl.rows, sl.NT, last)
            if h0 is not None:
                dh0 = carry
        else:
            reverse(dht, dh0, ch.cu, ch.cu[1:], ch.chunk_off)
        del reverse  # (its inputs hold DVL, W and dh)
    if not slices:
        del dh
        outs = per_chunk(ch.chunk_idx, chunk_rows(ch, dev), ch.NT, True)
    return (*outs, dh0)


def _merged(rb, q, k, v, do, gamma, beta, Ai, VN, h, h0, dht, ch: Chunks, scale: float, L: int, bnd, grad_dtype,
            dv_dtype):
    """:func:`backward`'s outputs from the merged kernel (delta.triton.fused_rbwd): one launch over the
    sequences, or over warm-started segments of ``L`` chunks, that forms each chunk's gradients
    from h and δ (the recomputed forward's) as soon as the state gradient leaving it exists: no dh,
    dδ or slices."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    dev, f32 = v.device, torch.float32
    DQ = torch.empty(T, HV, K, device=dev, dtype=grad_dtype)
    DK = torch.empty(T, HV, K, device=dev, dtype=grad_dtype)
    qc, kc, doc, VN = (cast(x, v.dtype) for x in (q, k, do, VN))
    # dV over δ where the dtypes agree: B stores a chunk's dV rows only after that chunk's δ has
    # landed in shared memory (the second slot's ready barrier), and no program reads δ rows but
    # its own chunks' (warm-up chunks read no δ), so no δ row is read after its dV is written
    dvt = dv_dtype or grad_dtype
    DV = VN if VN.dtype == dvt else torch.empty(T, HV, V, device=dev, dtype=dvt)
    DB = torch.empty(T, HV, device=dev, dtype=f32)
    DG = torch.empty(T, HV, device=dev, dtype=f32)
    dh0 = torch.empty(ch.N, HV, K, V, device=dev, dtype=f32) if h0 is not None else None
    warm, ranges = None, (ch.cu, ch.cu[1:], ch.chunk_off, ch.N)
    if L:
        sg = make_segments(ch, L, dev)
        warm = (warm_plan(bnd, gamma, sg, ch, HV, after=True), sg.seq, ch.cu)
        ranges = (sg.cu, sg.cu[1:], sg.off, sg.NS)
    rb.backward(qc, kc, v, doc, gamma, beta, Ai, VN, h, dht, dh0, DQ, DK, DV, DB, DG, *ranges, scale, warm=warm)
    if L:
        fill_empty(dh0, dht, ch)
    return DQ, DK, DV, DG, DB, dh0


def _per_chunk(q, k, v, g, beta, Ai, VN, do, h, dh, DD, gamma, ch: Chunks, scale: float, grad_dtype, dv_dtype):
    """The backward's per-chunk stage after the reverse pass: ``run(chunk_idx, rows, NT, last)`` fills the
    rows of those chunks (their states and dS_out at ``rows`` [NT, 2] of h and dh: common.Slice) of
    its outputs and returns them (dQ, dK, dV,
    dg, dβ; dg and dβ None where the member has no gate or no delta term); ``last``: no later call, so
    it may drop its inputs as it goes. On compute capability 9 for the gated delta members in 16
    bits one Gluon kernel (``fused_bwd``); else dqk then wy_bwd."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    delta, gated = beta is not None, g is not None
    prec, DT, io = dot_precision(v.dtype), tl_dtype(v.dtype), v.dtype
    dev, f32, dummy = v.device, torch.float32, v
    gp = g if gated else dummy
    fused = _fused_bwd() if DELTA["fused_bwd"]["on"] else None
    if fused is not None and fused.usable(q, g, beta, K, V):
        # dqk and wy_bwd's work in one Gluon kernel per chunk and value head
        outs, run = fused.backward(q, k, v, gamma, beta, Ai, VN, do, h, dh, DD, ch, scale, grad_dtype, dv_dtype)

        def fused_run(chunk_idx, rows, NT: int, last: bool):
            run(chunk_idx, rows, NT)
            return outs

        return fused_run
    BK, BV = tiles("dqk", K, V, io=io)
    NK = cdiv(K, BK)
    DQ = torch.empty(T, HV, K, device=dev, dtype=grad_dtype)
    # dK is final after dqk without the delta term; with it, wy_bwd adds two terms and writes DKO
    DK = torch.empty(T, HV, K, device=dev, dtype=f32 if delta else grad_dtype)
    DW = torch.empty(T, HV, K, device=dev, dtype=io) if delta else None
    DGAM = torch.empty(NK, T, HV, device=dev, dtype=f32) if gated else None  # dγ of each K tile
    # the value-loop inputs, perhaps as tensor descriptors (h and dh as [chunks · HV · K, V] rows);
    # dropped after the last dqk, and wy_bwd's outputs allocated at its first launch, so that the
    # peak (during dqk) holds h, dh, δ, dδ and dqk's outputs only
    tma, (vd, dod, ddd) = tile_reads("dqk", (VN if delta else v, BV), (do, BV), (DD if delta else v, BV))
    hd, dhd = h, dh
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415

        hd, dhd = (TensorDescriptor.from_tensor(x.view(-1, V), block_shape=[BK, BV]) for x in (h, dh))
    reads = [(v if not tma else vd, vd if delta else dummy, dod, hd, dhd, ddd if delta else dummy)]  # dqk's order
    del h, dh, VN, hd, dhd, vd, dod, ddd
    WK, WV = tiles("wy_bwd", K, V, io=io)
    outs = []

    def run(chunk_idx, rows, NT: int, last: bool):
        r = reads[0]
        launch(dqk_kernel, (NK, NT, HV), q, k, r[0], gp, *r[1:], DQ, DK,
               DW if delta else dummy, DGAM if gated else dummy, ch.cu, chunk_idx, rows, scale, T, H=H,
               HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, USE_G=gated, DELTA=delta, PREC=prec, DT=DT, TMA=tma, name="dqk", io=io)
        del r
        if last:
            reads.clear()
        if not outs:
            DKO = torch.empty(T, HV, K, device=dev, dtype=grad_dtype) if delta and grad_dtype != f32 else DK
            DV = torch.empty(T, HV, V, device=dev, dtype=dv_dtype or grad_dtype) if delta else DD
            DB = torch.empty(T, HV, device=dev, dtype=f32) if delta else None
            DG = torch.empty(T, HV, device=dev, dtype=f32) if gated else None
            outs.extend((DQ, DKO, DV, DG, DB))
        if delta or gated:
            launch(wy_bwd_kernel, (NT, HV),
                   k, v, gp, beta if delta else dummy, Ai if delta else dummy, DD, DW if delta else dummy, DK,
                   *outs[1:3], outs[4] if delta else dummy, DGAM if gated else dummy, outs[3] if gated else dummy,
                   ch.cu, chunk_idx, T, H=H, HV=HV, K=K, V=V, BT=BT, BK=WK, BV=WV, NK=NK, USE_G=gated, DELTA=delta,
                   PREC=prec, DT=DT, name="wy_bwd", io=io)
        return tuple(outs)

    return run
