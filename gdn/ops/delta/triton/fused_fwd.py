"""The forward's sequential pass of the gated delta rule in one Gluon kernel (``DELTA["fused_fwd"]``,
off by default: not yet timed in this form, docs/TRITON.md): the work of chunk_fwd's
``state_out_kernel`` with δ from the in-chunk inverse and kkt_solve's pair matrix, for 16-bit
inputs on compute capability 9.

The pass is a chain: each chunk's products need the state the previous chunk left. Per chunk and
value tile: X = K S, δ = T⁻¹ diag(β)(V − diag(Γ) X), S ← Γ_C S + Kᵀ diag(Γ_C / Γ) δ on the chain,
O = scale · (diag(Γ) Q S + P δ) beside it. It runs transposed (Xᵀ = Sᵀ Kᵀ, δᵀ = Xsᵀ T⁻ᵀ,
Sᵀ ← Γ_C Sᵀ + δ̃ᵀ K, Oᵀ = (Sᵀ Qᵀ) diag(Γ) + δᵀ Pᵀ) so that every product takes its left operand
from registers, where the previous product left it: nothing on the chain goes through shared
memory, which holds only the chunk's q, k, v, T⁻¹ and P tiles, brought by tensor copies into a
ring of ``NS`` slots (the next chunks' requested while this one computes). The state's value tile
stays in registers for the whole sequence as the fp32 accumulator of its own update. Same
arithmetic and roundings as ``state_out_kernel``'s ``FROM_INV`` + ``PRE_P`` form: S and X rounded
to the input dtype as MMA operands, δ rounded once, then scaled and rounded again for the update.

Gluon does not run under Triton's interpreter: the GPU tests check it (tests/gpu/test_fused_fwd.py);
on the CPU a transcription of its math is checked against the reference and the kernel is compiled
for sm_90 (tests/ops/test_fused_fwd_math.py, tools/gluon_budget.py).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ...triton.common import BT as CHUNK
from ...triton.launch import launch
from ...tuning import DELTA
from .fused_bwd import acc_layout, hopper_16bit, tile_descriptor

BT = gl.constexpr(CHUNK)


@gluon.jit
def _request(n, t0, i_h, i_hv, col, q_t, k_t, v_t, a_t, p_t, ring_q, ring_k, ring_v, ring_a, ring_p, bars, s,
             K: gl.constexpr):
    """Start the tensor copies of the chunk starting at row ``t0`` (q, k rows of key head i_h; v
    columns ``col``; T⁻¹ and P rows of value head i_hv) into ring slot ``s``; its barrier completes
    when all ``n`` bytes have landed."""
    bar = bars.index(s)
    mbarrier.expect(bar, n)
    tma.async_copy_global_to_shared(q_t, [t0, i_h * K], bar, ring_q.index(s))
    tma.async_copy_global_to_shared(k_t, [t0, i_h * K], bar, ring_k.index(s))
    tma.async_copy_global_to_shared(v_t, [t0, col], bar, ring_v.index(s))
    tma.async_copy_global_to_shared(a_t, [t0, i_hv * BT], bar, ring_a.index(s))
    tma.async_copy_global_to_shared(p_t, [t0, i_hv * BT], bar, ring_p.index(s))


@gluon.jit
def fused_fwd_kernel(q_t, k_t, v_t, a_t, p_t, G, beta, h0, o, ht, cu, scale, H, HV, K: gl.constexpr,
                     V: gl.constexpr, BV: gl.constexpr, NS: gl.constexpr, DT: gl.constexpr, USE_INIT: gl.constexpr,
                     STORE_FINAL: gl.constexpr):
    """One program per value tile i_v and (sequence, value head) i_nh, walking the sequence's chunks.
    Descriptors: q_t, k_t of [T, H · K] in [64, K] blocks; v_t of [T, HV · V] in [64, BV] blocks;
    a_t (T⁻¹ rows, kkt_solve's Ai) and p_t (the pair matrix Q Kᵀ ⊙ D, kkt_solve's) of [T, HV · 64]
    in [64, 64] blocks. G [T, HV] the in-chunk cumulative log decay γ; beta [T, HV] fp32; h0, ht
    [N, HV, K, V] fp32; o [T, HV, V]. BV = 64 (the MMAs' M).

    The chain runs transposed, so that each of its products takes its left operand from registers
    and only the copied tiles sit in shared memory: Xᵀ = Sᵀ Kᵀ, δᵀ = Xsᵀ T⁻ᵀ, Sᵀ ← Γ_C Sᵀ + δ̃ᵀ K,
    and beside it Oᵀ = (Sᵀ Qᵀ) diag(Γ) + δᵀ Pᵀ (Sᵀ [BV, K] is the accumulator of its own update).

    A chunk's block may reach into the next sequence's rows (or past T, where the copies give zeros):
    β reads 0 there, so X's rows are 0 and T⁻¹ (lower triangular) keeps the valid rows of δ clean;
    δ is zeroed on those rows before P δ and the state update, and their o rows are not stored."""
    f32: gl.constexpr = gl.float32
    num_warps: gl.constexpr = gl.num_warps()
    l_t: gl.constexpr = acc_layout(BT, num_warps)  # [BV, 64] accumulators: value columns × chunk rows
    l_s: gl.constexpr = acc_layout(K, num_warps)  # Sᵀ [BV, K]
    op_t: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_t, k_width=2)  # left operands into a_t
    op_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_s, k_width=2)  # and into l_s
    c_t: gl.constexpr = gl.SliceLayout(0, l_t)  # vectors over the chunk's rows
    st: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, num_warps], [0, 1])  # Oᵀ stored along V
    tile_bytes: gl.constexpr = (2 * BT * K + BT * BV + 2 * BT * BT) * 2  # 16-bit tiles
    i_v = gl.program_id(0)
    i_nh = gl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos = gl.load(cu + i_n)
    eos = gl.load(cu + i_n + 1)
    nc = (eos - bos + BT - 1) // BT
    col = i_hv * V + i_v * BV

    ring_q = gl.allocate_shared_memory(DT, [NS, BT, K], q_t.layout)
    ring_k = gl.allocate_shared_memory(DT, [NS, BT, K], k_t.layout)
    ring_v = gl.allocate_shared_memory(DT, [NS, BT, BV], v_t.layout)
    ring_a = gl.allocate_shared_memory(DT, [NS, BT, BT], a_t.layout)
    ring_p = gl.allocate_shared_memory(DT, [NS, BT, BT], p_t.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i_s in gl.static_range(NS):
        mbarrier.init(bars.index(i_s), count=1)
    fence_async_shared()
    for i_s in gl.static_range(NS):
        if i_s < nc:
            _request(tile_bytes, bos + i_s * BT, i_h, i_hv, col, q_t, k_t, v_t, a_t, p_t, ring_q, ring_k, ring_v,
                     ring_a, ring_p, bars, i_s, K)

    # Sᵀ, the state's value tile transposed, in the accumulator layout of its update
    o_vs = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, l_s))
    o_ks = gl.arange(0, K, layout=gl.SliceLayout(0, l_s))
    p_s = (i_n * HV + i_hv).to(gl.int64) * K * V + o_ks[None, :] * V + o_vs[:, None]
    if USE_INIT:
        b_s = gl.load(h0 + p_s)
    else:
        b_s = gl.zeros([BV, K], f32, l_s)
    o_t = gl.arange(0, BT, layout=c_t)
    o_vo = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, st))
    o_to = gl.arange(0, BT, layout=gl.SliceLayout(0, st))
    zero = gl.zeros([BV, BT], f32, l_t)
    for c in range(0, nc):
        s = c % NS
        t0 = bos + c * BT
        rt = t0 + o_t
        m = rt < eos
        last = gl.minimum(eos, t0 + BT) - 1
        g_t = gl.load(G + rt * HV + i_hv, mask=m, other=0.0)
        g_last = gl.load(G + last * HV + i_hv)
        b_b = gl.load(beta + rt * HV + i_hv, mask=m, other=0.0)
        mbarrier.wait(bars.index(s), (c // NS) & 1)
        sk = ring_k.index(s)
        b_x = warpgroup_mma(gl.convert_layout(b_s.to(DT), op_t), sk.permute((1, 0)), zero, use_acc=False,
                            is_async=True)
        b_vt = ring_v.index(s).permute((1, 0)).load(l_t).to(f32)
        b_g = gl.exp(g_t)
        b_x = warpgroup_mma_wait(0, deps=[b_x])
        b_y = gl.convert_layout(((b_vt - b_x * b_g[None, :]) * b_b[None, :]).to(DT), op_t)
        b_d = warpgroup_mma(b_y, ring_a.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        b_d = warpgroup_mma_wait(0, deps=[b_d])
        b_dt = gl.where(m[None, :], b_d, 0.0).to(DT)
        b_w = gl.where(m, gl.exp(g_last - g_t), 0.0)
        # Q S (from S before its update: the left operand is a converted copy) and the update
        # together, then P δ onto Γ Q S
        b_o = warpgroup_mma(gl.convert_layout(b_s.to(DT), op_t), ring_q.index(s).permute((1, 0)), zero,
                            use_acc=False, is_async=True)
        b_s = warpgroup_mma(gl.convert_layout((b_dt.to(f32) * b_w[None, :]).to(DT), op_s), sk,
                            b_s * gl.exp(g_last), is_async=True)
        b_o = warpgroup_mma_wait(1, deps=[b_o])
        b_o = warpgroup_mma(gl.convert_layout(b_dt, op_t), ring_p.index(s).permute((1, 0)), b_o * b_g[None, :],
                            is_async=True)
        b_s, b_o = warpgroup_mma_wait(0, deps=[b_s, b_o])
        gl.thread_barrier()  # every warp is done with slot s: request the chunk NS further on
        if c + NS < nc:
            _request(tile_bytes, t0 + NS * BT, i_h, i_hv, col, q_t, k_t, v_t, a_t, p_t, ring_q, ring_k, ring_v,
                     ring_a, ring_p, bars, s, K)
        ro = t0 + o_to
        p_o = (ro.to(gl.int64)[None, :] * HV + i_hv) * V + o_vo[:, None]
        gl.store(o + p_o, gl.convert_layout((b_o * scale).to(o.dtype.element_ty), st), mask=(ro < eos)[None, :])
    if STORE_FINAL:
        gl.store(ht + p_s, b_s)


def usable(q, g, beta, K: int, V: int, split: bool) -> bool:
    """Whether the Gluon pass takes this forward (``DELTA["fused_fwd"]["on"]``): gated delta member,
    ``hopper_16bit``, K of 64 or 128, V a multiple of the value tile, and no warm-started split (its
    segments run chunk_fwd's pass)."""
    return (bool(DELTA["fused_fwd"]["on"]) and g is not None and beta is not None and not split
            and hopper_16bit(q) and K in (64, 128) and V % DELTA["fused_fwd"]["BV"] == 0)


def forward(q, k, v, G, beta, Ai, pairs, h0, o, ht, ch, scale: float):
    """Run the pass: fills o [T, HV, V] and, when ``ht`` is given, the final state. q, k [T, H, K];
    v [T, HV, V] (16-bit, contiguous); G, beta [T, HV] fp32; Ai, pairs [T, HV, 64] from kkt_solve;
    h0 [N, HV, K, V] fp32 or None."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    c = DELTA["fused_fwd"]
    BV = c["BV"]
    DT = gl.bfloat16 if v.dtype == torch.bfloat16 else gl.float16
    q_t, k_t = (tile_descriptor(x, T, (CHUNK, K), DT) for x in (q, k))
    v_t = tile_descriptor(v, T, (CHUNK, BV), DT)
    a_t, p_t = (tile_descriptor(x, T, (CHUNK, CHUNK), DT) for x in (Ai, pairs))
    launch(fused_fwd_kernel, (V // BV, ch.N * HV), q_t, k_t, v_t, a_t, p_t, G, beta,
           h0 if h0 is not None else G, o, ht if ht is not None else G, ch.cu, scale, H, HV, K=K, V=V, BV=BV,
           NS=c["NS"], DT=DT, USE_INIT=h0 is not None, STORE_FINAL=ht is not None, name="fused_fwd")
