"""The per-chunk backward of the gated delta rule in one Gluon kernel (``DELTA["fused_bwd"]``, off:
not yet run on a GPU).

Gluon is Triton's explicit-layout language: the kernel places its accumulators over the warps and
every MMA operand in shared memory itself, which Triton's own compiler does not do within the
register file at K = 128 (docs/TRITON.md, "Fused dqk + wy_bwd"; ``tools/gluon_budget.py``). One
program per chunk and value head, two warpgroups. It takes what the reverse state pass leaves
(h, dh, δ, dδ; chunk_bwd.backward) and replaces dqk and wy_bwd, with the math of
chunk_bwd's docstring: over the value tiles it accumulates dO δᵀ, dδ δᵀ, dO Sᵀ, δ dSᵀ and
dδ Sᵀ and writes dV = diag(β) Tᵀ dδ; then dQ, dK, dβ and dg, with dA = −Tᵀ (dδ δᵀ) (δ = T X, so
dT Tᵀ = dδ δᵀ) taken as two 16-bit products (dδ δᵀ split into a rounded part and its remainder:
about 16 significant bits, more than tf32's 11). Gated delta members, 16-bit inputs, K ≤ 128.

Gluon does not run under Triton's interpreter: this kernel is checked on the GPU only
(tests/gpu/test_fused_bwd.py); the CPU tests compile it for sm_90 and check its resources.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from ...triton.common import BT as CHUNK
from ...triton.launch import launch
from ...tuning import DELTA, INTERPRET

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
def _vec(x, layout: gl.constexpr):
    return gl.convert_layout(x, layout)


@gluon.jit
def fused_bwd_kernel(q, k, v, G, beta, Ai, VN, do, h, dh, DD, DQ, DK, DV, DB, DG, cu, chunk_idx, scale, H, HV,
                     K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, DT: gl.constexpr):
    """One chunk i_t and value head i_hv. q, k [T, H, K]; v, VN (δ), do, DD (dδ) [T, HV, V]; h, dh
    [chunks, HV, K, V] (the state entering each chunk and the gradient of the one leaving it);
    G [T, HV] the in-chunk cumulative log decay γ; beta [T, HV]; Ai [T, HV, 64] the rows of T⁻¹.
    Writes dQ, dK [T, HV, K], dV [T, HV, V], dβ and dg [T, HV]."""
    f32: gl.constexpr = gl.float32
    num_warps: gl.constexpr = gl.num_warps()
    i_t = gl.program_id(0)
    i_hv = gl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n = gl.load(chunk_idx + 2 * i_t)
    i_c = gl.load(chunk_idx + 2 * i_t + 1).to(gl.int64)
    bos = gl.load(cu + i_n).to(gl.int64)
    eos = gl.load(cu + i_n + 1).to(gl.int64)
    t0 = bos + i_c * BT
    last = gl.minimum(eos, t0 + BT) - 1  # the chunk's last valid row

    ld_t: gl.constexpr = _rows(BT, num_warps)
    ld_k: gl.constexpr = _rows(K, num_warps)
    ld_v: gl.constexpr = _rows(BV, num_warps)
    a_t: gl.constexpr = acc_layout(BT, num_warps)
    a_k: gl.constexpr = acc_layout(K, num_warps)
    a_v: gl.constexpr = acc_layout(BV, num_warps)
    r_t: gl.constexpr = gl.SliceLayout(1, a_t)  # row vectors of [64, 64]
    c_t: gl.constexpr = gl.SliceLayout(0, a_t)
    r_k: gl.constexpr = gl.SliceLayout(1, a_k)  # row vectors of [64, K]
    r_v: gl.constexpr = gl.SliceLayout(1, a_v)

    # ---- shared memory: the value loop's five tiles, then the chunk's q, k, T and the epilogue's operands
    s_d = gl.allocate_shared_memory(DT, [BT, BV], _smem([BT, BV], DT))
    s_do = gl.allocate_shared_memory(DT, [BT, BV], _smem([BT, BV], DT))
    s_dd = gl.allocate_shared_memory(DT, [BT, BV], _smem([BT, BV], DT))
    s_h = gl.allocate_shared_memory(DT, [K, BV], _smem([K, BV], DT))
    s_dh = gl.allocate_shared_memory(DT, [K, BV], _smem([K, BV], DT))
    s_tt = gl.allocate_shared_memory(DT, [BT, BT], _smem([BT, BT], DT))  # Tᵀ
    s_q = gl.allocate_shared_memory(DT, [BT, K], _smem([BT, K], DT))
    s_k = gl.allocate_shared_memory(DT, [BT, K], _smem([BT, K], DT))
    s_kt = gl.allocate_shared_memory(DT, [K, BT], _smem([K, BT], DT))  # Kᵀ
    s_p = gl.allocate_shared_memory(DT, [BT, BT], _smem([BT, BT], DT))
    s_w = gl.allocate_shared_memory(DT, [BT, K], _smem([BT, K], DT))
    s_hi = gl.allocate_shared_memory(DT, [BT, BT], _smem([BT, BT], DT))
    s_lo = gl.allocate_shared_memory(DT, [BT, BT], _smem([BT, BT], DT))

    # rows of this chunk in the load layout, and its T⁻¹ rows stored transposed (Tᵀ is the A
    # operand of dV, Tᵀ dW and dA)
    rows_t = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, ld_t))
    o_64 = gl.arange(0, BT, layout=gl.SliceLayout(0, ld_t))
    b_a = gl.load(Ai + (rows_t[:, None] * HV + i_hv) * BT + o_64[None, :], mask=(rows_t < eos)[:, None], other=0.0)
    s_tt.store(gl.permute(b_a, (1, 0)))
    rows_k = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, ld_k))
    o_kc = gl.arange(0, K, layout=gl.SliceLayout(0, ld_k))
    p_qk = (rows_k[:, None] * H + i_h) * K + o_kc[None, :]
    b_q = gl.load(q + p_qk, mask=(rows_k < eos)[:, None], other=0.0)
    b_k = gl.load(k + p_qk, mask=(rows_k < eos)[:, None], other=0.0)
    s_q.store(b_q)
    s_k.store(b_k)
    s_kt.store(gl.permute(b_k, (1, 0)))

    # per-row scalars in the accumulators' row layouts
    rt = t0 + gl.arange(0, BT, layout=r_t)
    m_t = rt < eos
    g_t = gl.load(G + rt * HV + i_hv, mask=m_t, other=0.0)
    g_c = gl.convert_layout(g_t, c_t)
    g_last = gl.load(G + last * HV + i_hv)
    rv = t0 + gl.arange(0, BT, layout=r_v)
    m_v = rv < eos
    b_bv = gl.load(beta + rv * HV + i_hv, mask=m_v, other=0.0)

    # ---- the value loop
    dod = gl.zeros([BT, BT], f32, a_t)
    ddd = gl.zeros([BT, BT], f32, a_t)
    dqs = gl.zeros([BT, K], f32, a_k)
    dks = gl.zeros([BT, K], f32, a_k)
    wac = gl.zeros([BT, K], f32, a_k)  # dδ Sᵀ = −dW
    dbu = gl.zeros([BT], f32, r_v)  # dβ's U term
    gcs = gl.zeros([K], f32, gl.SliceLayout(1, ld_v))  # Σ_v S ⊙ dS per key row
    o_kr = gl.arange(0, K, layout=gl.SliceLayout(1, ld_v))
    o_bv = gl.arange(0, BV, layout=gl.SliceLayout(0, ld_v))
    rows = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, ld_v))
    m_r = rows < eos
    base_h = (i_t.to(gl.int64) * HV + i_hv) * K * V
    o_vv = gl.arange(0, BV, layout=gl.SliceLayout(0, a_v))
    fence_async_shared()
    gl.thread_barrier()
    tt_v = s_tt.load(gl.DotOperandLayout(operand_index=0, parent=a_v, k_width=2))
    for i_v in range(0, V // BV):
        cols = i_v * BV + o_bv
        p_t = (rows[:, None] * HV + i_hv) * V + cols[None, :]
        s_d.store(gl.load(VN + p_t, mask=m_r[:, None], other=0.0))
        s_do.store(gl.load(do + p_t, mask=m_r[:, None], other=0.0))
        s_dd.store(gl.load(DD + p_t, mask=m_r[:, None], other=0.0))
        p_s = base_h + o_kr[:, None] * V + cols[None, :]
        b_s = gl.load(h + p_s)
        b_ds = gl.load(dh + p_s)
        s_h.store(b_s)
        s_dh.store(b_ds)
        gcs += gl.sum(b_s.to(f32) * b_ds.to(f32), axis=1)
        fence_async_shared()
        gl.thread_barrier()
        dod = warpgroup_mma(s_do, s_d.permute((1, 0)), dod)
        ddd = warpgroup_mma(s_dd, s_d.permute((1, 0)), ddd)
        dqs = warpgroup_mma(s_do, s_h.permute((1, 0)), dqs)
        dks = warpgroup_mma(s_d, s_dh.permute((1, 0)), dks)
        wac = warpgroup_mma(s_dd, s_h.permute((1, 0)), wac)
        # dV = diag(β) Tᵀ dδ for this value tile, and dβ's term Σ_v v ⊙ (Tᵀ dδ)
        b_y = warpgroup_mma(tt_v, s_dd, gl.zeros([BT, BV], f32, a_v), use_acc=False)
        p_o = (rv[:, None] * HV + i_hv) * V + (i_v * BV + o_vv)[None, :]
        gl.store(DV + p_o, (b_y * b_bv[:, None]).to(DV.dtype.element_ty), mask=m_v[:, None])
        b_v = gl.load(v + p_o, mask=m_v[:, None], other=0.0).to(f32)
        dbu += gl.sum(b_v * b_y, axis=1)
        gl.thread_barrier()  # every warpgroup's products are done before the tiles are overwritten

    # ---- the epilogue, ordered so that each accumulator is consumed as early as it can be: first
    # dW = −dδ Sᵀ and dδ δ ᵀ (as a rounded part and its remainder) go to shared memory
    s_w.store((0.0 - wac).to(DT))
    hi = ddd.to(DT)
    s_hi.store(hi)
    s_lo.store((ddd - hi.to(f32)).to(DT))
    # dQ and the output and state terms of dK (dqk_kernel's math); rows past the sequence end are
    # kept out of the decays (γ reads 0 there, and exp(γ_i − γ_j) could overflow against a zero)
    lower = (rt[:, None] >= (t0 + gl.arange(0, BT, layout=c_t))[None, :]) & m_t[:, None]
    dsm = dod * gl.exp(gl.where(lower, g_t[:, None] - g_c[None, :], float("-inf"))) * scale
    g_k = gl.convert_layout(g_t, r_k)
    dqs = dqs * (scale * gl.exp(g_k))[:, None]
    dg = _vec(gl.sum(s_q.load(a_k).to(f32) * dqs, axis=1), r_t)
    b_dq = warpgroup_mma(gl.convert_layout(dsm.to(DT), gl.DotOperandLayout(operand_index=0, parent=a_k, k_width=2)),
                         s_k, dqs)
    rk = t0 + gl.arange(0, BT, layout=r_k)
    m_k = rk < eos
    o_kk = gl.arange(0, K, layout=gl.SliceLayout(0, a_k))
    p_out = (rk[:, None] * HV + i_hv) * K + o_kk[None, :]
    gl.store(DQ + p_out, b_dq.to(DQ.dtype.element_ty), mask=m_k[:, None])
    s_p.store(gl.permute(dsm.to(DT), (1, 0)))  # (dO δᵀ ⊙ D)ᵀ, the A operand of its product with Q
    dks = dks * gl.exp(g_last - g_k)[:, None]
    b_a = gl.sum(s_k.load(a_k).to(f32) * dks, axis=1)
    dg -= _vec(b_a, r_t)
    tail = gl.sum(b_a, axis=0) + gl.exp(g_last) * gl.sum(gcs, axis=0)
    dg += gl.where(rt == last, tail, 0.0)
    fence_async_shared()
    gl.thread_barrier()
    b_dk = warpgroup_mma(s_p, s_q, dks)
    b_e = warpgroup_mma(s_q, s_kt, gl.zeros([BT, BT], f32, a_t), use_acc=False) * dsm
    dg += gl.sum(b_e, axis=1) - _vec(gl.sum(b_e, axis=0), r_t)

    # ---- the terms through W = T diag(βΓ) K: Tᵀ dW
    b_bk = gl.load(beta + rk * HV + i_hv, mask=m_k, other=0.0)
    bg_k = b_bk * gl.exp(g_k)
    tdw = warpgroup_mma(s_tt.load(gl.DotOperandLayout(operand_index=0, parent=a_k, k_width=2)), s_w,
                        gl.zeros([BT, K], f32, a_k), use_acc=False)
    ktdw = gl.sum(s_k.load(a_k).to(f32) * tdw, axis=1)
    b_dk += tdw * bg_k[:, None]
    db = _vec(ktdw * gl.exp(g_k) + _vec(dbu, r_k), r_t)
    dg += _vec(ktdw * bg_k, r_t)

    # ---- the terms through A: dA = −Tᵀ (dδ δᵀ)
    tt_t = s_tt.load(gl.DotOperandLayout(operand_index=0, parent=a_t, k_width=2))
    b_da = warpgroup_mma(tt_t, s_hi, gl.zeros([BT, BT], f32, a_t), use_acc=False)
    b_da = warpgroup_mma(tt_t, s_lo, b_da)
    strict = (rt[:, None] > (t0 + gl.arange(0, BT, layout=c_t))[None, :]) & m_t[:, None]
    b_da = 0.0 - gl.where(strict, b_da * gl.exp(gl.where(strict, g_t[:, None] - g_c[None, :], float("-inf"))), 0.0)
    b_kk = warpgroup_mma(s_k, s_kt, gl.zeros([BT, BT], f32, a_t), use_acc=False)
    db += gl.sum(b_da * b_kk, axis=1)
    b_bt = gl.load(beta + rt * HV + i_hv, mask=m_t, other=0.0)
    b_m = b_da * b_bt[:, None]
    b_e2 = b_m * b_kk
    dg += gl.sum(b_e2, axis=1) - _vec(gl.sum(b_e2, axis=0), r_t)
    # dK += (M + Mᵀ) K
    gl.thread_barrier()  # every warpgroup's product with (dO δᵀ ⊙ D)ᵀ is done before s_p is reused
    s_p.store(b_m.to(DT))
    fence_async_shared()
    gl.thread_barrier()
    b_dk = warpgroup_mma(s_p, s_k, b_dk)
    b_dk = warpgroup_mma(s_p.permute((1, 0)), s_k, b_dk)
    gl.store(DK + p_out, b_dk.to(DK.dtype.element_ty), mask=m_k[:, None])
    gl.store(DB + rt * HV + i_hv, db, mask=m_t)
    # dg = the reverse in-chunk cumsum of dγ, as a masked row sum (a scan in the MMA row layout
    # does not lower for sm_90 in triton 3.6)
    after = (t0 + gl.arange(0, BT, layout=c_t))[None, :] >= rt[:, None]
    gl.store(DG + rt * HV + i_hv, gl.sum(gl.where(after, _vec(dg, c_t)[None, :], 0.0), axis=1), mask=m_t)


def usable(q, g, beta, K: int, V: int) -> bool:
    """Whether the fused kernel takes this call (``DELTA["fused_bwd"]["on"]``): gated delta member,
    16-bit inputs on a CUDA device of compute capability 9 (warpgroup MMAs), K of 32 to 128 and V a
    multiple of the value tile."""
    c = DELTA["fused_bwd"]
    return (bool(c["on"]) and g is not None and beta is not None and q.is_cuda and not INTERPRET
            and q.dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(q.device)[0] == 9
            and K in (32, 64, 128) and V % c["BV"] == 0)


def backward(q, k, v, G, beta, Ai, VN, do, h, dh, DD, ch, scale: float, grad_dtype, dv_dtype):
    """(dQ, dK, dV, dg, dβ) of the chunk op from the reverse pass's results (chunk_bwd.backward)."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    dev, f32 = v.device, torch.float32
    DQ = torch.empty(T, HV, K, device=dev, dtype=grad_dtype)
    DK = torch.empty(T, HV, K, device=dev, dtype=grad_dtype)
    DV = torch.empty(T, HV, V, device=dev, dtype=dv_dtype or grad_dtype)
    DB = torch.empty(T, HV, device=dev, dtype=f32)
    DG = torch.empty(T, HV, device=dev, dtype=f32)
    DT = gl.bfloat16 if v.dtype == torch.bfloat16 else gl.float16
    launch(fused_bwd_kernel, (ch.NT, HV), q, k, v, G, beta, Ai, VN, do, h, dh, DD, DQ, DK, DV, DB, DG, ch.cu,
           ch.chunk_idx, scale, H, HV, K=K, V=V, BV=DELTA["fused_bwd"]["BV"], DT=DT, name="fused_bwd")
    return DQ, DK, DV, DG, DB
