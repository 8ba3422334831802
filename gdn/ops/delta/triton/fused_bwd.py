"""The per-chunk backward of the gated delta rule in one Gluon kernel (``DELTA["fused_bwd"]``), taken
on compute capability 9 for 16-bit inputs and K ≤ 128 instead of chunk_bwd's dqk and wy_bwd.

Gluon is Triton's explicit-layout language: the kernel places its accumulators over the warps and
every MMA operand in shared memory itself, which Triton's own compiler does not do within the
register file at K = 128 (docs/TRITON.md, "Fused dqk + wy_bwd"; ``tools/gluon_budget.py``). Each
program takes ``DELTA["fused_bwd"]["items"]`` consecutive (chunk, value head) items (default one),
two warpgroups. It takes what the reverse state pass leaves
(h, dh, δ, dδ; chunk_bwd.backward), with the math of chunk_bwd's docstring: over the value tiles
(brought in by tensor copies, two tiles ahead) it accumulates dO δᵀ, dδ δᵀ, dO Sᵀ, δ dSᵀ and dδ Sᵀ
and writes dV = diag(β) Tᵀ dδ; then dQ, dK, dβ and dg, with dA = −Tᵀ (dδ δᵀ) (δ = T X, so
dT Tᵀ = dδ δᵀ) taken as two 16-bit products (dδ δᵀ split into a rounded part and its remainder:
about 16 significant bits, more than tf32's 11). The products that do not depend on each other run
asynchronously together.

Gluon does not run under Triton's interpreter: this kernel is checked on the GPU only
(tests/gpu/test_fused_bwd.py); the CPU tests compile it for sm_90 and check its resources.
"""
from __future__ import annotations


import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ...triton.common import BT as CHUNK, cast
from ...triton.launch import descriptor_key, launch, major
from ...tuning import DELTA, INTERPRET, cdiv

BT = gl.constexpr(CHUNK)  # chunk rows, as the Triton chunk kernels'


@gluon.constexpr_function
def acc_layout(N, num_warps):
    """Layout of a [64, N] fp32 accumulator of warpgroup MMAs: four warps down the rows (16 each),
    the warpgroups splitting N."""
    wn = num_warps // 4
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, wn], instr_shape=[16, N // wn, 16])


@gluon.constexpr_function
def _rows(W, num_warps):
    """Register layout of [R, W] tiles loaded from memory: eight consecutive values a thread, a
    warp's threads across the W columns, the warps down the rows."""
    return gl.BlockedLayout([1, 8], [32 // (W // 8), W // 8], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _smem(shape, dtype):
    return gl.NVMMASharedLayout.get_default_for(shape, dtype)


@gluon.jit
def _chunk(w, HV, cu, chunk_idx):
    """(i_t, i_hv, sequence, its chunk, the chunk's first row) of item ``w`` = i_t · HV + i_hv: chunk
    i_t of ``chunk_idx``, value head i_hv (the first row a 32-bit coordinate, as tensor copies take)."""
    i_t = w // HV
    i_hv = w % HV
    i_n = gl.load(chunk_idx + 2 * i_t)
    i_c = gl.load(chunk_idx + 2 * i_t + 1)
    return i_t, i_hv, i_n, i_c, gl.load(cu + i_n) + i_c * BT


@gluon.jit
def _issue(n, w, i_v, s, HV, cu, chunk_idx, rows, d_t, do_t, dd_t, v_t, h_t, dh_t, ring_d, ring_do, ring_dd,
           ring_v, ring_h, ring_dh, bars, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr):
    """Start the tensor copies of item ``w``'s value tile ``i_v`` (δ, dO, dδ, v rows; h, dh rows) into
    ring slot ``s``; its barrier completes when all ``n`` bytes have landed."""
    i_t, i_hv, i_n, i_c, t0 = _chunk(w, HV, cu, chunk_idx)
    col = i_hv * V + i_v * BV
    row_h = (gl.load(rows + 2 * i_t) * HV + i_hv) * K  # the chunk's state row in h
    row = (gl.load(rows + 2 * i_t + 1) * HV + i_hv) * K  # and its dS_out row in dh
    bar = bars.index(s)
    mbarrier.expect(bar, n)
    tma.async_copy_global_to_shared(d_t, [t0, col], bar, ring_d.index(s))
    tma.async_copy_global_to_shared(do_t, [t0, col], bar, ring_do.index(s))
    tma.async_copy_global_to_shared(dd_t, [t0, col], bar, ring_dd.index(s))
    tma.async_copy_global_to_shared(v_t, [t0, col], bar, ring_v.index(s))
    tma.async_copy_global_to_shared(h_t, [row_h, i_v * BV], bar, ring_h.index(s))
    tma.async_copy_global_to_shared(dh_t, [row, i_v * BV], bar, ring_dh.index(s))


@gluon.jit
def _where(w, HV, H, cu, chunk_idx):
    """(first row, sequence end, value head, key head) of item ``w`` (:func:`_chunk`)."""
    _, i_hv, i_n, _, r0 = _chunk(w, HV, cu, chunk_idx)
    return r0, gl.load(cu + i_n + 1), i_hv, i_hv // (HV // H)


@gluon.jit
def _issue_qk(w, HV, H, cu, chunk_idx, q_t, k_t, s_q, s_k, bar, K: gl.constexpr):
    """Start the tensor copies of item ``w``'s q and k rows (its key head's) on ``bar``."""
    r0, _, _, i_h = _where(w, HV, H, cu, chunk_idx)
    mbarrier.expect(bar, 2 * K * BT * 2)
    tma.async_copy_global_to_shared(q_t, [r0, i_h * K], bar, s_q)
    tma.async_copy_global_to_shared(k_t, [r0, i_h * K], bar, s_k)


@gluon.jit
def _issue_inv(w, HV, H, cu, chunk_idx, ai_t, s_a, bar):
    """Start the tensor copy of item ``w``'s rows of T⁻¹ on ``bar``."""
    r0, _, i_hv, _ = _where(w, HV, H, cu, chunk_idx)
    mbarrier.expect(bar, BT * BT * 2)
    tma.async_copy_global_to_shared(ai_t, [r0, i_hv * BT], bar, s_a)


@gluon.jit
def _item(J: gl.constexpr, PER: gl.constexpr, w, NW, q_t, k_t, G, beta, ai_t, d_t, do_t, dd_t, v_t, h_t, dh_t, DQ, DK,
          DV, dq_t, dk_t, dv_t, DB, DG, cu, chunk_idx, rows, scale, H, HV, ring_d, ring_do, ring_dd, ring_v,
          ring_h, ring_dh, bars, bar_qk, bars_a, s_as, s_q, s_k, s_p, s_w, s_hi, s_lo, K: gl.constexpr,
          V: gl.constexpr, BV: gl.constexpr, NS: gl.constexpr, DT: gl.constexpr, QK_TMA: gl.constexpr,
          DV_TMA: gl.constexpr):
    """Item ``w``, the program's J-th of PER (fused_bwd_kernel's docstring). The program's first item
    requests its first value tiles, its T⁻¹ (slot 0 of ``s_as``) and its q and k once its per-row
    scalars are requested; a later item's were requested by the item before: once its value loop
    is done, the next item's first value tiles and T⁻¹ (slot (J + 1) % 2), and once its dQ and dK
    have left q's and k's places, the next item's q and k."""
    f32: gl.constexpr = gl.float32
    num_warps: gl.constexpr = gl.num_warps()
    NV: gl.constexpr = V // BV
    ld_t: gl.constexpr = _rows(BT, num_warps)
    ld_k: gl.constexpr = _rows(K, num_warps)
    ld_v: gl.constexpr = _rows(BV, num_warps)
    a_t: gl.constexpr = acc_layout(BT, num_warps)
    a_k: gl.constexpr = acc_layout(K, num_warps)
    a_v: gl.constexpr = acc_layout(BV, num_warps)
    r_t: gl.constexpr = gl.SliceLayout(1, a_t)  # row vectors of [64, 64]
    c_t: gl.constexpr = gl.SliceLayout(0, a_t)  # column vectors of [64, 64]
    r_k: gl.constexpr = gl.SliceLayout(1, a_k)  # row vectors of [64, K]
    r_v: gl.constexpr = gl.SliceLayout(1, a_v)  # row vectors of [64, BV]
    tile_bytes: gl.constexpr = (4 * BT + 2 * K) * BV * 2  # 16-bit tiles
    NEXT: gl.constexpr = J + 1 < PER  # a later item of this program may follow
    s_a = s_as.index(J % 2)
    bar_a = bars_a.index(J % 2)

    r0, eos, i_hv, i_h = _where(w, HV, H, cu, chunk_idx)
    t0 = r0.to(gl.int64)
    eos = eos.to(gl.int64)
    last = gl.minimum(eos, t0 + BT) - 1  # the chunk's last valid row
    partial = t0 + BT > eos  # the chunk ends inside its block

    # ---- every per-row scalar the item needs, requested before any wait on a tensor copy, each in
    # the layout that uses it (γ in three: loaded thrice rather than converted)
    rt = t0 + gl.arange(0, BT, layout=r_t)
    ct = t0 + gl.arange(0, BT, layout=c_t)
    rk = t0 + gl.arange(0, BT, layout=r_k)
    rv = t0 + gl.arange(0, BT, layout=r_v)
    m_t = rt < eos
    m_k = rk < eos
    m_v = rv < eos
    g_t = gl.load(G + rt * HV + i_hv, mask=m_t, other=0.0)
    g_c = gl.load(G + ct * HV + i_hv, mask=ct < eos, other=0.0)
    g_k = gl.load(G + rk * HV + i_hv, mask=m_k, other=0.0)
    g_last = gl.load(G + last * HV + i_hv)
    b_bt = gl.load(beta + rt * HV + i_hv, mask=m_t, other=0.0)
    b_bk = gl.load(beta + rk * HV + i_hv, mask=m_k, other=0.0)
    b_bv = gl.load(beta + rv * HV + i_hv, mask=m_v, other=0.0)
    o_vv = gl.arange(0, BV, layout=gl.SliceLayout(0, a_v))
    m_ld = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, ld_v)) < eos
    if J == 0:
        # the program's first item requests its tensor copies here, after its per-row scalars (whose
        # loads would otherwise queue behind ≈ 170 KB of copies), in the order they are waited for:
        # T⁻¹ and the first value tiles (the loop's), then q and k (the epilogue's)
        _issue_inv(w, HV, H, cu, chunk_idx, ai_t, s_as.index(0), bars_a.index(0))
        for i_s in gl.static_range(min(NS, NV)):
            _issue(tile_bytes, w, i_s, i_s, HV, cu, chunk_idx, rows, d_t, do_t, dd_t, v_t, h_t, dh_t, ring_d,
                   ring_do, ring_dd, ring_v, ring_h, ring_dh, bars, K, V, BV)
        _issue_qk(w, HV, H, cu, chunk_idx, q_t, k_t, s_q, s_k, bar_qk, K)

    # ---- the value loop
    dod = gl.zeros([BT, BT], f32, a_t)
    ddd = gl.zeros([BT, BT], f32, a_t)
    dqs = gl.zeros([BT, K], f32, a_k)
    dks = gl.zeros([BT, K], f32, a_k)
    wac = gl.zeros([BT, K], f32, a_k)  # dδ Sᵀ = −dW
    dbu = gl.zeros([BT], f32, r_v)  # dβ's U term
    gcs = gl.zeros([K], f32, gl.SliceLayout(1, ld_v))  # Σ_v S ⊙ dS per key row
    # T⁻¹, zeroed past the sequence end (Tᵀ, its transposed view, is the A operand of dV, Tᵀ dW and dA)
    mbarrier.wait(bar_a, (J // 2) & 1)
    if partial:
        m_lt = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, ld_t)) < eos
        x = s_a.load(ld_t)
        s_a.store(gl.where(m_lt[:, None], x, gl.zeros_like(x)))
        fence_async_shared()
        gl.thread_barrier()
    s_tt = s_a.permute((1, 0))
    for i_v in range(0, NV):
        n = J * NV + i_v  # the program's tile count: ring slot and barrier phase
        s = n % NS
        mbarrier.wait(bars.index(s), (n // NS) & 1)
        sd = ring_d.index(s)
        sdo = ring_do.index(s)
        sdd = ring_dd.index(s)
        sh = ring_h.index(s)
        sdh = ring_dh.index(s)
        if partial:
            x = sdd.load(ld_v)
            sdd.store(gl.where(m_ld[:, None], x, gl.zeros_like(x)))
            fence_async_shared()
            gl.thread_barrier()
        dod = warpgroup_mma(sdo, sd.permute((1, 0)), dod, is_async=True)
        ddd = warpgroup_mma(sdd, sd.permute((1, 0)), ddd, is_async=True)
        dqs = warpgroup_mma(sdo, sh.permute((1, 0)), dqs, is_async=True)
        dks = warpgroup_mma(sd, sdh.permute((1, 0)), dks, is_async=True)
        wac = warpgroup_mma(sdd, sh.permute((1, 0)), wac, is_async=True)
        # dV = diag(β) Tᵀ dδ for this value tile, and dβ's term Σ_v v ⊙ (Tᵀ dδ)
        b_y = warpgroup_mma(s_tt, sdd, gl.zeros([BT, BV], f32, a_v), use_acc=False, is_async=True)
        gcs += gl.sum(sh.load(ld_v).to(f32) * sdh.load(ld_v).to(f32), axis=1)
        b_v = ring_v.index(s).load(a_v).to(f32)
        dod, ddd, dqs, dks, wac, b_y = warpgroup_mma_wait(0, deps=[dod, ddd, dqs, dks, wac, b_y])
        dbu += gl.sum(b_v * b_y, axis=1)
        # every warpgroup is done with slot s. dV's tile goes out from the dδ tile's place (a tensor
        # copy, which has read it before the slot takes the tile NS further on), or through masked
        # stores in a chunk that ends early
        gl.thread_barrier()
        dv = b_y * b_bv[:, None]
        p_o = (rv[:, None] * HV + i_hv) * V + (i_v * BV + o_vv)[None, :]
        if DV_TMA:
            if partial:
                gl.store(DV + p_o, dv.to(DV.dtype.element_ty), mask=m_v[:, None])
            else:
                sdd.store(dv.to(DT))
                fence_async_shared()
                gl.thread_barrier()
                tma.async_copy_shared_to_global(dv_t, [r0, i_hv * V + i_v * BV], sdd)
                if i_v + NS < NV:
                    tma.store_wait(0)
                    gl.thread_barrier()
        else:
            gl.store(DV + p_o, dv.to(DV.dtype.element_ty), mask=m_v[:, None])
        if i_v + NS < NV:
            _issue(tile_bytes, w, i_v + NS, s, HV, cu, chunk_idx, rows, d_t, do_t, dd_t,
                   v_t, h_t, dh_t, ring_d, ring_do, ring_dd, ring_v, ring_h, ring_dh, bars, K, V, BV)
    if NEXT:
        # the next item's first value tiles into the slots this loop is done with (once dV's copies
        # out of them have read them) and its T⁻¹ into the other slot: they land during this epilogue
        if w + 1 < NW:
            tma.store_wait(0)
            gl.thread_barrier()
            for i_s in gl.static_range(min(NS, NV)):
                _issue(tile_bytes, w + 1, i_s, ((J + 1) * NV + i_s) % NS, HV, cu, chunk_idx, rows, d_t, do_t,
                       dd_t, v_t, h_t, dh_t, ring_d, ring_do, ring_dd, ring_v, ring_h, ring_dh, bars, K, V, BV)
            _issue_inv(w + 1, HV, H, cu, chunk_idx, ai_t, s_as.index((J + 1) % 2), bars_a.index((J + 1) % 2))

    # ---- the epilogue. q and k (zeroed past the sequence end), then dW = −dδ Sᵀ and dδ δᵀ (as a
    # rounded part and its remainder) to shared memory, and the five products that need nothing
    # else start at once (operands in shared memory): Q Kᵀ, K Kᵀ, Tᵀ dW and Tᵀ (dδ δᵀ) in two parts
    mbarrier.wait(bar_qk, J & 1)
    if partial:
        m_lk = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, ld_k)) < eos
        x = s_q.load(ld_k)
        s_q.store(gl.where(m_lk[:, None], x, gl.zeros_like(x)))
        x = s_k.load(ld_k)
        s_k.store(gl.where(m_lk[:, None], x, gl.zeros_like(x)))
    s_w.store((0.0 - wac).to(DT))
    hi = ddd.to(DT)
    s_hi.store(hi)
    s_lo.store((ddd - hi.to(f32)).to(DT))
    fence_async_shared()
    gl.thread_barrier()
    b_e = warpgroup_mma(s_q, s_k.permute((1, 0)), gl.zeros([BT, BT], f32, a_t), use_acc=False, is_async=True)
    b_kk = warpgroup_mma(s_k, s_k.permute((1, 0)), gl.zeros([BT, BT], f32, a_t), use_acc=False, is_async=True)
    tdw = warpgroup_mma(s_tt, s_w, gl.zeros([BT, K], f32, a_k), use_acc=False, is_async=True)
    b_da = warpgroup_mma(s_tt, s_hi, gl.zeros([BT, BT], f32, a_t), use_acc=False, is_async=True)
    b_da = warpgroup_mma(s_tt, s_lo, b_da, is_async=True)
    # meanwhile the decay matrix D (exp(γ_i − γ_j) on and below the diagonal, zero above it and in
    # rows past the sequence end, where γ reads 0 and the difference could overflow), formed once for
    # both its uses, and the output and state terms of dQ and dK (dqk_kernel's math). dγ is gathered
    # by layout: its terms from [64, K] rows (dg_k), from [64, 64] rows (dg_t) and columns (dg_c),
    # converted once each at the end
    lower = (rt[:, None] >= ct[None, :]) & m_t[:, None]
    dec = gl.exp(gl.where(lower, g_t[:, None] - g_c[None, :], float("-inf")))
    dsm = dod * dec * scale
    e_k = gl.exp(g_k)
    dqs = dqs * (scale * e_k)[:, None]
    dg_k = gl.sum(s_q.load(a_k).to(f32) * dqs, axis=1)
    dks = dks * gl.exp(g_last - g_k)[:, None]
    b_a = gl.sum(s_k.load(a_k).to(f32) * dks, axis=1)
    dg_k -= b_a
    tail = gl.sum(b_a, axis=0) + gl.exp(g_last) * gl.sum(gcs, axis=0)
    s_p.store(gl.permute(dsm.to(DT), (1, 0)))  # (dO δᵀ ⊙ D)ᵀ, the A operand of its product with Q
    o_kk = gl.arange(0, K, layout=gl.SliceLayout(0, a_k))
    p_out = (rk[:, None] * HV + i_hv) * K + o_kk[None, :]
    b_e, b_kk, tdw, b_da = warpgroup_mma_wait(0, deps=[b_e, b_kk, tdw, b_da])
    b_e = b_e * dsm
    dg_t = gl.sum(b_e, axis=1)
    dg_c = 0.0 - gl.sum(b_e, axis=0)

    # ---- the terms through W = T diag(βΓ) K: Tᵀ dW
    bg_k = b_bk * e_k
    ktdw = gl.sum(s_k.load(a_k).to(f32) * tdw, axis=1)
    dks += tdw * bg_k[:, None]
    db_k = ktdw * e_k + gl.convert_layout(dbu, r_k)
    dg_k += ktdw * bg_k

    # ---- the terms through A: dA = −Tᵀ (dδ δᵀ) ⊙ D below the diagonal
    strict = lower & (rt[:, None] != ct[None, :])
    b_da = 0.0 - gl.where(strict, b_da * dec, 0.0)
    db = gl.sum(b_da * b_kk, axis=1) + gl.convert_layout(db_k, r_t)
    b_m = b_da * b_bt[:, None]
    b_e2 = b_m * b_kk
    dg_t += gl.sum(b_e2, axis=1)
    dg_c -= gl.sum(b_e2, axis=0)
    gl.thread_barrier()  # both warpgroups' products from s_hi are done
    s_hi.store(b_m.to(DT))  # M
    fence_async_shared()
    gl.thread_barrier()
    # dQ = (dO δᵀ ⊙ D) K + ..., dK = (dO δᵀ ⊙ D)ᵀ Q + (M + Mᵀ) K + ...
    b_dq = warpgroup_mma(s_p.permute((1, 0)), s_k, dqs, is_async=True)
    b_dk = warpgroup_mma(s_p, s_q, dks, is_async=True)
    b_dk = warpgroup_mma(s_hi, s_k, b_dk, is_async=True)
    b_dk = warpgroup_mma(s_hi.permute((1, 0)), s_k, b_dk, is_async=True)
    # meanwhile dβ, and dγ in the column layout its reverse in-chunk cumsum takes (a masked row sum:
    # a scan in the MMA row layout does not lower for sm_90 in triton 3.6)
    gl.store(DB + rt * HV + i_hv, db, mask=m_t)
    dg_c += gl.where(ct == last, tail, 0.0)
    dg_c += gl.convert_layout(dg_t + gl.convert_layout(dg_k, r_t), c_t)
    after = ct[None, :] >= rt[:, None]
    gl.store(DG + rt * HV + i_hv, gl.sum(gl.where(after, dg_c[None, :], 0.0), axis=1), mask=m_t)
    b_dq, b_dk = warpgroup_mma_wait(0, deps=[b_dq, b_dk])
    if QK_TMA:
        if partial:
            gl.store(DQ + p_out, b_dq.to(DQ.dtype.element_ty), mask=m_k[:, None])
            gl.store(DK + p_out, b_dk.to(DK.dtype.element_ty), mask=m_k[:, None])
        else:
            # out from q's and k's places, once both warpgroups' products have read them
            gl.thread_barrier()
            s_q.store(b_dq.to(DT))
            s_k.store(b_dk.to(DT))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(dq_t, [r0, i_hv * K], s_q)
            tma.async_copy_shared_to_global(dk_t, [r0, i_hv * K], s_k)
    else:
        gl.store(DQ + p_out, b_dq.to(DQ.dtype.element_ty), mask=m_k[:, None])
        gl.store(DK + p_out, b_dk.to(DK.dtype.element_ty), mask=m_k[:, None])
    if NEXT:
        # the next item's q and k into their places once dQ and dK have left them and both
        # warpgroups' products are done with them
        if w + 1 < NW:
            tma.store_wait(0)
            gl.thread_barrier()
            _issue_qk(w + 1, HV, H, cu, chunk_idx, q_t, k_t, s_q, s_k, bar_qk, K)


@gluon.jit(do_not_specialize=["NW"])
def fused_bwd_kernel(q_t, k_t, G, beta, ai_t, d_t, do_t, dd_t, v_t, h_t, dh_t, DQ, DK, DV, dq_t, dk_t, dv_t, DB, DG, cu,
                     chunk_idx, rows, scale, H, HV, NW, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                     NS: gl.constexpr, DT: gl.constexpr, QK_TMA: gl.constexpr, DV_TMA: gl.constexpr,
                     PER: gl.constexpr):
    """PER consecutive items a program (the last program's items past ``NW`` are skipped), item w =
    i_t · HV + i_hv being chunk i_t of ``chunk_idx`` (all of the call's chunks, or a slice of them)
    and value head i_hv. G [T, HV] the in-chunk cumulative log decay γ; beta [T, HV]. Descriptors:
    q_t, k_t of [T, H · K] in [64, K] blocks; ai_t of the rows of T⁻¹ [T, HV · 64] in [64, 64]
    blocks; d_t (δ), do_t (dO), dd_t (dδ), v_t (v) of [T, HV · V] in [64, BV] blocks; h_t, dh_t of
    [rows · HV · K, V] (the state entering chunk i_t at row rows[i_t, 0] of h, the gradient of the
    one leaving it at row rows[i_t, 1] of dh) in [K, BV] blocks. Writes dQ, dK [T, HV, K], dV [T,
    HV, V], dβ and dg [T, HV]: a chunk that fills its block writes dQ and dK by tensor copies (dq_t,
    dk_t, [64, K] blocks of [T, HV · K]) where ``QK_TMA`` and dV likewise (dv_t) where ``DV_TMA``
    (outputs in the inputs' 16-bit dtype), every other chunk through masked stores.

    Every input comes by tensor copies, requested before it is needed: q and k on one barrier (read
    after the value loop), T⁻¹ on another (two slots, so that the next item's lands during this
    one's epilogue), the value tiles through a ring of NS slots (tile i + NS as soon as tile i's
    slot is free, the next item's first tiles as soon as this item's loop is done); the products
    run asynchronously. A chunk's block may reach into the next sequence's rows. Those rows of δ,
    dO and v are finite (written before this kernel runs) and need no zeroing: every product that
    meets them is masked to the chunk's valid rows afterwards, or passes through T⁻¹'s rows, which
    are zero there (T⁻¹ is lower triangular, so its valid rows never reach a later column). In a
    chunk that ends early, q's, k's and T⁻¹'s rows past the end are zeroed in shared memory once
    they land, and so are the dδ tile's: the reverse pass may not have written those yet (a sliced
    pass writes them with a later slice), and zero times a non-finite value is not zero."""
    w0 = gl.program_id(0) * PER

    # ---- shared memory: the ring of value tiles, then q, k, two slots of T⁻¹ (Tᵀ is its transposed
    # view) and the epilogue's operands
    ring_d = gl.allocate_shared_memory(DT, [NS, BT, BV], d_t.layout)
    ring_do = gl.allocate_shared_memory(DT, [NS, BT, BV], d_t.layout)
    ring_dd = gl.allocate_shared_memory(DT, [NS, BT, BV], d_t.layout)
    ring_v = gl.allocate_shared_memory(DT, [NS, BT, BV], d_t.layout)
    ring_h = gl.allocate_shared_memory(DT, [NS, K, BV], h_t.layout)
    ring_dh = gl.allocate_shared_memory(DT, [NS, K, BV], h_t.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    bar_qk = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    NA: gl.constexpr = 2 if PER > 1 else 1
    bars_a = gl.allocate_shared_memory(gl.int64, [NA, 1], mbarrier.MBarrierLayout())
    s_as = gl.allocate_shared_memory(DT, [NA, BT, BT], ai_t.layout)
    s_q = gl.allocate_shared_memory(DT, [BT, K], q_t.layout)
    s_k = gl.allocate_shared_memory(DT, [BT, K], k_t.layout)
    s_p = gl.allocate_shared_memory(DT, [BT, BT], _smem([BT, BT], DT))
    s_w = gl.allocate_shared_memory(DT, [BT, K], _smem([BT, K], DT))
    s_hi = gl.allocate_shared_memory(DT, [BT, BT], _smem([BT, BT], DT))
    s_lo = gl.allocate_shared_memory(DT, [BT, BT], _smem([BT, BT], DT))
    for i_s in gl.static_range(NS):
        mbarrier.init(bars.index(i_s), count=1)
    for i_s in gl.static_range(NA):
        mbarrier.init(bars_a.index(i_s), count=1)
    mbarrier.init(bar_qk, count=1)
    fence_async_shared()
    for j in gl.static_range(PER):
        if PER == 1 or w0 + j < NW:  # (every program has a first item)
            _item(j, PER, w0 + j, NW, q_t, k_t, G, beta, ai_t, d_t, do_t, dd_t, v_t, h_t, dh_t, DQ, DK, DV, dq_t, dk_t,
                  dv_t, DB, DG, cu, chunk_idx, rows, scale, H, HV, ring_d, ring_do, ring_dd, ring_v, ring_h,
                  ring_dh, bars, bar_qk, bars_a, s_as, s_q, s_k, s_p, s_w, s_hi, s_lo, K, V, BV, NS, DT, QK_TMA,
                  DV_TMA)
    tma.store_wait(0)


def value_tile(V: int) -> int:
    """The value tile for V: ``DELTA["fused_bwd"]["BV"]`` where it divides V, else 32 (0: neither does)."""
    return next((b for b in (DELTA["fused_bwd"]["BV"], 32) if V % b == 0), 0)


def usable(q, g, beta, K: int, V: int) -> bool:
    """Whether the fused kernel takes this call (``DELTA["fused_bwd"]["on"]``): gated delta member,
    16-bit inputs on a CUDA device of compute capability 9 (warpgroup MMAs), K of 32 to 128 and V a
    multiple of 32."""
    return (bool(DELTA["fused_bwd"]["on"]) and g is not None and beta is not None
            and q.dtype in (torch.bfloat16, torch.float16) and K in (32, 64, 128) and value_tile(V) > 0 and hopper(q))


def hopper(q) -> bool:
    """Whether ``q``'s device runs the Gluon kernels (this one and delta.triton.fused_fwd): CUDA
    compute capability 9 (warpgroup MMAs, tensor copies, register reallocation between warpgroups),
    never the interpreter (Gluon has none)."""
    return q.is_cuda and not INTERPRET and major(q.device) == 9


_TILES: dict = {}


def _tile(block: tuple, dt, x_dtype) -> tuple:
    """(shared-memory layout, launch key) of a ``block`` tile of a ``x_dtype`` tensor read as ``dt``,
    made once (a layout costs ≈ 15 µs of host to build; the key is what launch.descriptor_key gives
    every descriptor of it). Looked up by ``dt``'s name: a Triton dtype's own hash runs Python code."""
    k = (block, dt.name, x_dtype)
    hit = _TILES.get(k)
    if hit is None:
        layout = _smem(list(block), dt)
        hit = _TILES[k] = (layout, descriptor_key(TensorDescriptor, x_dtype, block, layout, "zero"))
    return hit


def _tiles(x, rows: int, block: tuple, dt):
    """A tensor descriptor of ``x`` as a row-major [rows, ·] matrix read in ``block``s (of a
    contiguous, 16-byte aligned copy where ``x`` is neither). Its shape and strides are worked out
    here rather than through a reshaped view: the launch reads only the base's address and dtype."""
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    cols = x.numel() // rows
    layout, key = _tile(block, dt, x.dtype)
    d = descriptor(x, (rows, cols), (cols, 1), list(block), layout)
    d.launch_key = key
    return d


def descriptor(x, shape: tuple, strides: tuple, block: list, layout):
    """``TensorDescriptor.from_tensor(x.view(shape), block, layout)`` for a contiguous, 16-byte
    aligned ``x`` whose rows are whole 16-byte multiples (what :func:`_tiles` makes), less the
    constructor's checks of those facts, block and layout (fixed per tile shape): its fields are
    set directly, as the launch reads them. The checks are most of a descriptor's host time."""
    d = TensorDescriptor.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = x, shape, strides, block, layout, "zero"
    return d


def backward(q, k, v, G, beta, Ai, VN, do, h, dh, DD, ch, scale: float, grad_dtype, dv_dtype):
    """(dQ, dK, dV, dg, dβ) of the chunk op, allocated, and ``run(chunk_idx, rows, NT)``, which fills
    their rows of those NT chunks (``chunk_idx`` [NT, 2] as ``Chunks.chunk_idx``; ``rows`` [NT, 2]
    their states' rows in h and their dS_out's in dh, common.Slice) from the reverse pass's results
    (chunk_bwd.backward)."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    dev, f32 = v.device, torch.float32
    BV = value_tile(V)
    # dV is written over dδ and dQ over δ where shape and dtype allow: a program reads its chunk's
    # rows of both (tensor copies into its ring) before it writes a value tile of dV (after that
    # tile's products) or dQ (after the value loop), and reads no other program's rows but those
    # past its sequence's end, which it masks. The backward's peak then holds h, dh, δ, dδ and dK
    # besides the saved tensors, not dQ and dV as well.
    dv_dtype = dv_dtype or grad_dtype
    DQ = (VN if VN.shape == (T, HV, K) and VN.dtype == grad_dtype
          else torch.empty(T, HV, K, device=dev, dtype=grad_dtype))
    DK = torch.empty(T, HV, K, device=dev, dtype=grad_dtype)
    DV = DD if DD.dtype == dv_dtype else torch.empty(T, HV, V, device=dev, dtype=dv_dtype)
    DB = torch.empty(T, HV, device=dev, dtype=f32)
    DG = torch.empty(T, HV, device=dev, dtype=f32)
    DT = gl.bfloat16 if v.dtype == torch.bfloat16 else gl.float16
    d_t, do_t, dd_t, v_t = (_tiles(cast(x, v.dtype), T, (CHUNK, BV), DT) for x in (VN, do, DD, v))
    h_t, dh_t = (_tiles(x, x.numel() // V, (K, BV), DT) for x in (h, dh))
    q_t, k_t = (_tiles(cast(x, v.dtype), T, (CHUNK, K), DT) for x in (q, k))
    ai_t = _tiles(Ai, T, (CHUNK, CHUNK), DT)
    # dQ, dK and dV leave by tensor copies where they are in the inputs' dtype (the copies go out
    # from the shared memory of q, k and the dδ tile); the descriptors stand in for one another
    # where an output takes masked stores instead (that code is compiled out)
    qk_tma = DQ.dtype == DK.dtype == v.dtype
    dv_tma = DV.dtype == v.dtype
    dq_t, dk_t = (_tiles(DQ, T, (CHUNK, K), DT), _tiles(DK, T, (CHUNK, K), DT)) if qk_tma else (q_t, k_t)
    # (dV over dδ, the usual case, goes out through dδ's own descriptor)
    dv_t = dd_t if not dv_tma or dd_t.base is DV else _tiles(DV, T, (CHUNK, BV), DT)

    def run(chunk_idx, rows, NT: int):
        c = DELTA["fused_bwd"]
        PER = c["items"]
        launch(fused_bwd_kernel, (cdiv(NT * HV, PER),), q_t, k_t, G, beta, ai_t, d_t, do_t, dd_t, v_t, h_t,
               dh_t, DQ, DK, DV, dq_t, dk_t, dv_t, DB, DG, ch.cu, chunk_idx, rows, scale, H, HV, NT * HV, K=K,
               V=V, BV=BV, NS=c["NS"], DT=DT, QK_TMA=qk_tma, DV_TMA=dv_tma, PER=PER, name="fused_bwd")

    return (DQ, DK, DV, DG, DB), run
