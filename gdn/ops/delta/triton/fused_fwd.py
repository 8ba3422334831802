"""The forward's sequential pass of the gated delta rule in one Gluon kernel (``DELTA["fused_fwd"]``,
off by default: slower than state_out so far, docs/TRITON.md): the work of chunk_fwd's ``state_out_kernel`` with δ from the in-chunk inverse and
kkt_solve's pair matrix, for 16-bit inputs on compute capability 9.

The pass is a chain: each chunk's products need the state the previous chunk left. Per chunk and
value tile it runs X = K S and Q S (both from S in shared memory), δ = T⁻¹ diag(β)(V − diag(Γ) X),
O = scale · (diag(Γ) Q S + P δ) and S ← Γ_C S + Kᵀ diag(Γ_C / Γ) δ: three warpgroup MMAs on the
chain (K S, T⁻¹ X, Kᵀ δ̃) and two beside it (Q S, P δ). The chunk's q, k, v, T⁻¹ and P tiles come by
tensor copies into a ring of ``NS`` slots, the next chunks' requested while this one computes; the
state stays in registers as the fp32 accumulator of its own update (one program holds its value
tile of S for the whole sequence). Same arithmetic and roundings as ``state_out_kernel``'s
``FROM_INV`` + ``PRE_P`` form: S and X rounded to the input dtype as MMA operands, δ rounded once,
then scaled and rounded again for the state update.

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
from ...tuning import DELTA, INTERPRET
from .fused_bwd import _smem, _tile_layout, acc_layout, descriptor

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
    [N, HV, K, V] fp32; o [T, HV, V].

    A chunk's block may reach into the next sequence's rows (or past T, where the copies give zeros):
    β reads 0 there, so X's rows are 0 and T⁻¹ (lower triangular) keeps the valid rows of δ clean;
    δ is zeroed on those rows before P δ and the state update, and their o rows are not stored."""
    f32: gl.constexpr = gl.float32
    num_warps: gl.constexpr = gl.num_warps()
    a_v: gl.constexpr = acc_layout(BV, num_warps)  # [64, BV] and [K, BV] fp32 accumulators
    r_v: gl.constexpr = gl.SliceLayout(1, a_v)
    c_v: gl.constexpr = gl.SliceLayout(0, a_v)
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
    s_s = gl.allocate_shared_memory(DT, [K, BV], _smem([K, BV], DT))  # S: the B operand of K S and Q S
    # X = diag(β)(V − diag(Γ) K S), then (its product done) δ̃ = diag(Γ_C / Γ) δ; and δ
    s_x = gl.allocate_shared_memory(DT, [BT, BV], _smem([BT, BV], DT))
    s_d = gl.allocate_shared_memory(DT, [BT, BV], _smem([BT, BV], DT))
    for i_s in gl.static_range(NS):
        mbarrier.init(bars.index(i_s), count=1)
    fence_async_shared()
    for i_s in gl.static_range(NS):
        if i_s < nc:
            _request(tile_bytes, bos + i_s * BT, i_h, i_hv, col, q_t, k_t, v_t, a_t, p_t, ring_q, ring_k, ring_v,
                     ring_a, ring_p, bars, i_s, K)

    # the state's value tile, in the accumulator layout of its update
    o_k = gl.arange(0, K, layout=r_v)
    o_c = i_v * BV + gl.arange(0, BV, layout=c_v)
    p_s = (i_n * HV + i_hv).to(gl.int64) * K * V + o_k[:, None] * V + o_c[None, :]
    if USE_INIT:
        b_s = gl.load(h0 + p_s)
    else:
        b_s = gl.zeros([K, BV], f32, a_v)
    o_t = gl.arange(0, BT, layout=r_v)
    zero = gl.zeros([BT, BV], f32, a_v)
    for c in range(0, nc):
        s = c % NS
        t0 = bos + c * BT
        rt = t0 + o_t
        m = rt < eos
        last = gl.minimum(eos, t0 + BT) - 1
        g_t = gl.load(G + rt * HV + i_hv, mask=m, other=0.0)
        g_last = gl.load(G + last * HV + i_hv)
        b_b = gl.load(beta + rt * HV + i_hv, mask=m, other=0.0)
        s_s.store(b_s.to(DT))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.wait(bars.index(s), (c // NS) & 1)
        sk = ring_k.index(s)
        b_x = warpgroup_mma(sk, s_s, zero, use_acc=False, is_async=True)
        b_o = warpgroup_mma(ring_q.index(s), s_s, zero, use_acc=False, is_async=True)
        b_v = ring_v.index(s).load(a_v).to(f32)
        b_g = gl.exp(g_t)
        b_x = warpgroup_mma_wait(1, deps=[b_x])  # K S (Q S may still run)
        s_x.store(((b_v - b_x * b_g[:, None]) * b_b[:, None]).to(DT))
        fence_async_shared()
        gl.thread_barrier()
        b_d = warpgroup_mma(ring_a.index(s), s_x, zero, use_acc=False, is_async=True)
        b_d, b_o = warpgroup_mma_wait(0, deps=[b_d, b_o])
        gl.thread_barrier()  # every warpgroup's T⁻¹ X is done before δ̃ takes X's place
        b_dt = gl.where(m[:, None], b_d, 0.0).to(DT)
        s_d.store(b_dt)
        b_w = gl.where(m, gl.exp(g_last - g_t), 0.0)
        s_x.store((b_dt.to(f32) * b_w[:, None]).to(DT))
        fence_async_shared()
        gl.thread_barrier()
        b_o = warpgroup_mma(ring_p.index(s), s_d, b_o * b_g[:, None], is_async=True)
        b_s = warpgroup_mma(sk.permute((1, 0)), s_x, b_s * gl.exp(g_last), is_async=True)
        b_o, b_s = warpgroup_mma_wait(0, deps=[b_o, b_s])
        gl.thread_barrier()  # every warp is done with slot s: request the chunk NS further on
        if c + NS < nc:
            _request(tile_bytes, t0 + NS * BT, i_h, i_hv, col, q_t, k_t, v_t, a_t, p_t, ring_q, ring_k, ring_v,
                     ring_a, ring_p, bars, s, K)
        p_o = (rt.to(gl.int64)[:, None] * HV + i_hv) * V + o_c[None, :]
        gl.store(o + p_o, (b_o * scale).to(o.dtype.element_ty), mask=m[:, None])
    if STORE_FINAL:
        gl.store(ht + p_s, b_s)


def usable(q, g, beta, K: int, V: int, split: bool) -> bool:
    """Whether the Gluon pass takes this forward (``DELTA["fused_fwd"]["on"]``): gated delta member,
    16-bit inputs on a CUDA device of compute capability 9, K of 64 or 128, V a multiple of the
    value tile, and no warm-started split (its segments run chunk_fwd's pass)."""
    return (bool(DELTA["fused_fwd"]["on"]) and g is not None and beta is not None and not split and q.is_cuda
            and not INTERPRET and q.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(q.device)[0] == 9 and K in (64, 128)
            and V % DELTA["fused_fwd"]["BV"] == 0)


def forward(q, k, v, G, beta, Ai, pairs, h0, o, ht, ch, scale: float):
    """Run the pass: fills o [T, HV, V] and, when ``ht`` is given, the final state. q, k [T, H, K];
    v [T, HV, V] (16-bit, contiguous); G, beta [T, HV] fp32; Ai, pairs [T, HV, 64] from kkt_solve;
    h0 [N, HV, K, V] fp32 or None."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    c = DELTA["fused_fwd"]
    BV = c["BV"]
    DT = gl.bfloat16 if v.dtype == torch.bfloat16 else gl.float16

    def tiles(x, block):
        x = x.reshape(T, -1)
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.contiguous()
        return descriptor(x, [CHUNK, block], _tile_layout((CHUNK, block), DT))

    q_t, k_t, v_t = tiles(q, K), tiles(k, K), tiles(v, BV)
    a_t, p_t = tiles(Ai, CHUNK), tiles(pairs, CHUNK)
    launch(fused_fwd_kernel, (V // BV, ch.N * HV), q_t, k_t, v_t, a_t, p_t, G, beta,
           h0 if h0 is not None else G, o, ht if ht is not None else G, ch.cu, scale, H, HV, K=K, V=V, BV=BV,
           NS=c["NS"], DT=DT, USE_INIT=h0 is not None, STORE_FINAL=ht is not None, name="fused_fwd")
