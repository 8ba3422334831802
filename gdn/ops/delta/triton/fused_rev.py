"""The backward's reverse state pass of the gated delta rule as one warp-specialised Gluon kernel
(``DELTA["fused_rev"]``): the work of chunk_bwd's ``dv_local_kernel`` and ``state_bwd_kernel``
(its ``FROM_INV`` form) for 16-bit inputs on compute capability 9, one program per (sequence, a
slice of it or a warm-started segment; value head; value tile) holding a [K, VT] column tile of the
state gradient. The mirror of :mod:`.fused_fwd`.

The pass is separable in value columns, as the forward is: dδ, dO, Z, dÕ and the update of one
column of dS read no other column of them. So a head of V columns runs as NVT = V / VT programs of
VT = fused_fwd.value_tile(V) = min(V, 128) columns each (V = 256: two; the whole [K, 256] gradient
and its tiles would not fit a multiprocessor's shared memory). Each reads its own columns of dO,
dht and writes its own of dh, DD and dh0; the q, k and T tiles and Pᵀ are the same for every value
tile of a head, copied and formed again by each program, and a warm-started segment's warm-up
count (per segment and head) is shared by the head's tiles.

The pass is a chain walked last chunk first: each chunk's products need the state gradient dS the
later chunks left (dS_out, the gradient of the state leaving the chunk). Per chunk (dS, dO, dδ, Z,
dÕ: the program's VT columns):

    dδ = scale · Pᵀ dO + diag(Γ_C / Γ) K dS_out              (the chain; Pᵀ dO beside it)
    dS_in = Γ_C dS_out + Qᵀ diag(scale · Γ) dO − Kᵀ diag(βΓ) (Tᵀ dδ)    (the chain)

with P = Q Kᵀ ⊙ D the chunk's pair matrix (D_ij = exp(γ_i − γ_j) for i ≥ j, else 0) and T the
in-chunk inverse (kkt_solve's Ai). dS_out goes to dh and dδ to DD for the per-chunk stage
(:mod:`.fused_bwd`), dS_in of the first chunk to dh0.

Four roles run side by side in one program, each in warps of its own, handing tiles through shared
memory and mbarriers:

- the state warpgroup (the default partition) holds dS in fp32 registers as the accumulator of its
  own update; per chunk it writes dS in 16 bits to shared memory (copied from there to dh by a
  tensor store), adds Qᵀ dÕ (dÕ = diag(scale · Γ) dO) onto Γ_C dS, then waits for Z and adds Kᵀ Z;
- the δ warpgroup forms K dS, dδ = diag(Γ_C / Γ) K dS + L (stored to DD), then
  Z = −diag(βΓ) Tᵀ dδ;
- the local warpgroup forms Pᵀ = K Qᵀ ⊙ Dᵀ from the copied tiles, L = scale · Pᵀ dO and dÕ: the
  work that needs no state, a chunk ahead of the chain;
- one copy warp fills a ring of ``NS`` slots with each chunk's q, k, dO and T tiles by tensor
  copies, as soon as the three warpgroups have released the slot.

So the chain is three products (K dS, Tᵀ dδ, Kᵀ Z) and a handshake each way per chunk. The
arithmetic and roundings are state_bwd_kernel's ``FROM_INV`` form after dv_local_kernel: Pᵀ in
the input dtype, L rounded once, dδ rounded once, dÕ and Z rounded as MMA operands.

A chunk's rows past the program's end (the next sequence's, or past T where the copies give zeros)
read β = 0 and have dO and dδ zeroed, so they add nothing to dS, dδ or L. Gluon does not run under
Triton's interpreter: the GPU tests check the kernel (tests/gpu/test_fused_rev.py); the CPU tests
compile it for sm_90 (tests/test_fused_rev.py).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ...triton.common import BT as CHUNK
from ...triton.launch import launch, sm_count
from ...tuning import DELTA
from .fused_bwd import _tiles, acc_layout, hopper
from .fused_fwd import _edges, _program, value_tile

BT = gl.constexpr(CHUNK)
WG = gl.constexpr(4)  # warps of a warpgroup: each role but the copies'


@gluon.jit
def _span(cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, WARM: gl.constexpr):
    """(first row, end, warm-up chunks, chunks in all) of program i_n: tokens [cu[i_n], ends[i_n]),
    and with ``WARM`` (a segment of sequence seg_seq[i_n], bounded by seq_cu) the warm-up chunks
    after them (plan [NS, HV], split.warm_plan's ``after`` walk), which the walk takes first."""
    bos = gl.load(cu + i_n)
    eos = gl.load(ends + i_n)
    nw = 0
    if WARM:
        nw = gl.load(plan + i_n * HV + i_hv)
        eos = gl.minimum(eos + nw * BT, gl.load(seq_cu + gl.load(seg_seq + i_n) + 1))
    return bos, eos, nw, (eos - bos + BT - 1) // BT


@gluon.jit
def _copies(q_t, k_t, do_t, a_t, ring_q, ring_k, ring_do, ring_a, ready, empty, cu, ends, plan, seg_seq, seq_cu,
            i_n, i_h, i_hv, col, HV, K: gl.constexpr, V: gl.constexpr, VT: gl.constexpr, WARM: gl.constexpr):
    """The copy warp: step j's tiles (chunk nc − 1 − j) into slot j % NS once the slot's readers
    released it (of dO the program's VT columns from the head's column ``col``)."""
    NS: gl.constexpr = ring_k.shape[0]
    nbytes: gl.constexpr = (2 * BT * K + BT * VT + BT * BT) * 2
    bos, eos, nw, nc = _span(cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, WARM)
    for j in range(nc):
        s = j % NS
        mbarrier.wait(empty.index(s), ((j // NS) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        bar = ready.index(s)
        t0 = bos + (nc - 1 - j) * BT
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(k_t, [t0, i_h * K], bar, ring_k.index(s))
        tma.async_copy_global_to_shared(q_t, [t0, i_h * K], bar, ring_q.index(s))
        tma.async_copy_global_to_shared(do_t, [t0, i_hv * V + col], bar, ring_do.index(s))
        tma.async_copy_global_to_shared(a_t, [t0, i_hv * BT], bar, ring_a.index(s))


@gluon.jit
def _state(ring_q, ring_k, ready, empty, s_buf, s_ready, s_empty, o_buf, o_ready, o_empty, z_buf, z_ready, z_empty,
           G, dht, dh0, dh_t, cu, ends, off, plan, seg_seq, seq_cu, i_n, i_hv, col, HV, K: gl.constexpr,
           V: gl.constexpr, VT: gl.constexpr, DT: gl.constexpr, USE_DHT: gl.constexpr, USE_INIT: gl.constexpr,
           WARM: gl.constexpr, CARRY: gl.constexpr):
    """The state warpgroup: dS [K, VT] (the head's [K, V] state gradient's value columns from
    ``col``) in fp32 registers from dht (or zero), published in 16 bits per chunk and copied to dh
    (descriptor dh_t of [chunks · HV · K, V] in [K, VT] blocks, at column ``col`` of the chunk's
    index off[i_n] + its index in the program's chunks), updated to Γ_C dS + Qᵀ dÕ + Kᵀ Z; dS_in of
    the first chunk to dh0 (dht and dh0 read and written at the tile's columns). ``WARM``: it starts
    from dht only where its warm-up reaches the sequence's end, stores nothing on warm-up chunks and
    dS_in only if the segment starts the sequence; ``CARRY``: dS_in of every program, at its own
    index of dh0."""
    NS: gl.constexpr = ring_k.shape[0]
    l_s: gl.constexpr = acc_layout(VT, WG)
    bos, eos, nw, nc = _span(cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, WARM)
    i_seq, at_start, at_end = _edges(seg_seq, seq_cu, i_n, bos, eos, WARM)
    o_k = gl.arange(0, K, layout=gl.SliceLayout(1, l_s))
    o_v = col + gl.arange(0, VT, layout=gl.SliceLayout(0, l_s))  # (col folded in, as in fused_fwd)
    base = (i_seq * HV + i_hv).to(gl.int64) * K * V  # (offsets formed where used, as in fused_fwd)
    if USE_DHT:
        b_s = gl.load(dht + base + o_k[:, None] * V + o_v[None, :], mask=(o_k < K)[:, None] & at_end, other=0.0)
    else:
        b_s = gl.zeros([K, VT], gl.float32, l_s)
    c0 = gl.load(off + i_n)
    for j in range(nc):
        s = j % NS
        par = j & 1
        i_c = nc - 1 - j
        mbarrier.wait(s_empty, par ^ 1)  # the δ warpgroup is done with the previous dS
        tma.store_wait(0)  # and so is the copy of it out to dh
        s_buf.store(b_s.to(DT))
        fence_async_shared()
        mbarrier.arrive(s_ready, count=1)
        if j >= nw:
            tma.async_copy_shared_to_global(dh_t, [((c0 + i_c) * HV + i_hv) * K, col], s_buf)
        last = gl.minimum(eos, bos + (i_c + 1) * BT) - 1
        b_gc = gl.exp(gl.load(G + last * HV + i_hv))
        mbarrier.wait(ready.index(s), (j // NS) & 1)
        mbarrier.wait(o_ready, par)
        b_s = warpgroup_mma(ring_q.index(s).permute((1, 0)), o_buf, b_s * b_gc, is_async=True)
        mbarrier.wait(z_ready, par)
        b_s = warpgroup_mma(ring_k.index(s).permute((1, 0)), z_buf, b_s, is_async=True)
        b_s = warpgroup_mma_wait(0, deps=[b_s])
        mbarrier.arrive(o_empty, count=1)
        mbarrier.arrive(z_empty, count=1)
        mbarrier.arrive(empty.index(s), count=1)
    if USE_INIT:
        if CARRY:
            at_start = True
            base = (i_n * HV + i_hv).to(gl.int64) * K * V
        gl.store(dh0 + base + o_k[:, None] * V + o_v[None, :], b_s, mask=(o_k < K)[:, None] & at_start)
    tma.store_wait(0)


@gluon.jit
def _delta(ring_k, ring_a, ready, empty, s_buf, s_ready, s_empty, l_buf, l_ready, l_empty, d_buf, z_buf, z_ready,
           z_empty, G, beta, DD, cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, col, HV, V: gl.constexpr,
           VT: gl.constexpr, DT: gl.constexpr, WARM: gl.constexpr):
    """The δ warpgroup, on the program's VT value columns: dδ = diag(Γ_C / Γ) K dS + L (zero on rows
    past the end; stored to its columns of DD [T, HV, V] but on warm-up chunks), then
    Z = −diag(βΓ) Tᵀ dδ for the state's update."""
    NS: gl.constexpr = ring_k.shape[0]
    l_v: gl.constexpr = acc_layout(VT, WG)
    r_v: gl.constexpr = gl.SliceLayout(1, l_v)
    bos, eos, nw, nc = _span(cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, WARM)
    o_t = gl.arange(0, BT, layout=r_v)
    o_v = col + gl.arange(0, VT, layout=gl.SliceLayout(0, l_v))  # (the first column folded in)
    zero = gl.zeros([BT, VT], gl.float32, l_v)
    for j in range(nc):
        s = j % NS
        par = j & 1
        t0 = bos + (nc - 1 - j) * BT
        rt = t0 + o_t
        m = rt < eos
        last = gl.minimum(eos, t0 + BT) - 1
        g_t = gl.load(G + rt * HV + i_hv, mask=m, other=0.0)
        b_b = gl.load(beta + rt * HV + i_hv, mask=m, other=0.0)
        g_last = gl.load(G + last * HV + i_hv)
        b_w = gl.where(m, gl.exp(g_last - g_t), 0.0)
        mbarrier.wait(ready.index(s), (j // NS) & 1)
        mbarrier.wait(s_ready, par)
        b_x = warpgroup_mma(ring_k.index(s), s_buf, zero, use_acc=False, is_async=True)
        b_x = warpgroup_mma_wait(0, deps=[b_x])
        mbarrier.arrive(s_empty, count=1)
        mbarrier.wait(l_ready, par)
        b_d = (b_x * b_w[:, None] + l_buf.load(l_v).to(gl.float32)).to(DT)
        mbarrier.arrive(l_empty, count=1)
        d_buf.store(b_d)
        fence_async_shared()
        b_z = warpgroup_mma(ring_a.index(s).permute((1, 0)), d_buf, zero, use_acc=False, is_async=True)
        p_d = (rt.to(gl.int64)[:, None] * HV + i_hv) * V + o_v[None, :]
        gl.store(DD + p_d, b_d, mask=m[:, None] & (j >= nw))
        b_z = warpgroup_mma_wait(0, deps=[b_z])
        b_z = (b_z * (-b_b * gl.exp(g_t))[:, None]).to(DT)
        mbarrier.wait(z_empty, par ^ 1)  # the state's previous update has read Z
        z_buf.store(b_z)
        fence_async_shared()
        mbarrier.arrive(z_ready, count=1)
        mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def _local(ring_q, ring_k, ring_do, ready, empty, p_buf, l_buf, l_ready, l_empty, o_buf, o_ready, o_empty, G, cu,
           ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, scale, VT: gl.constexpr, DT: gl.constexpr,
           WARM: gl.constexpr):
    """The local warpgroup: Pᵀ = K Qᵀ ⊙ Dᵀ (columns of rows past the end zeroed, so the next
    sequence's dO adds nothing), L = scale · Pᵀ dO and dÕ = diag(scale · Γ) dO (zero past the end),
    on the program's VT value columns of dO (the ring's tiles: it indexes no global column)."""
    NS: gl.constexpr = ring_k.shape[0]
    l_v: gl.constexpr = acc_layout(VT, WG)
    r_v: gl.constexpr = gl.SliceLayout(1, l_v)
    l_t: gl.constexpr = acc_layout(BT, WG)
    o_r = gl.arange(0, BT, layout=gl.SliceLayout(1, l_t))
    o_c = gl.arange(0, BT, layout=gl.SliceLayout(0, l_t))
    zero_t = gl.zeros([BT, BT], gl.float32, l_t)
    zero = gl.zeros([BT, VT], gl.float32, l_v)
    bos, eos, nw, nc = _span(cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, WARM)
    o_t = gl.arange(0, BT, layout=r_v)
    for j in range(nc):
        s = j % NS
        par = j & 1
        t0 = bos + (nc - 1 - j) * BT
        mbarrier.wait(ready.index(s), (j // NS) & 1)
        b_p = warpgroup_mma(ring_k.index(s), ring_q.index(s).permute((1, 0)), zero_t, use_acc=False)
        g_r = gl.load(G + (t0 + o_r) * HV + i_hv, mask=t0 + o_r < eos, other=0.0)
        g_c = gl.load(G + (t0 + o_c) * HV + i_hv, mask=t0 + o_c < eos, other=0.0)
        keep = (o_c[None, :] >= o_r[:, None]) & (t0 + o_c < eos)[None, :]
        b_p = b_p * gl.exp(gl.where(keep, g_c[None, :] - g_r[:, None], float("-inf")))
        p_buf.store(b_p.to(DT))
        fence_async_shared()
        b_l = warpgroup_mma(p_buf, ring_do.index(s), zero, use_acc=False)
        mbarrier.wait(l_empty, par ^ 1)  # the δ warpgroup has read the previous L
        l_buf.store((b_l * scale).to(DT))
        fence_async_shared()
        mbarrier.arrive(l_ready, count=1)
        rt = t0 + o_t
        m = rt < eos
        g_t = gl.load(G + rt * HV + i_hv, mask=m, other=0.0)
        b_o = ring_do.index(s).load(l_v).to(gl.float32) * gl.where(m, scale * gl.exp(g_t), 0.0)[:, None]
        mbarrier.wait(o_empty, par ^ 1)  # the state's previous update has read dÕ
        o_buf.store(b_o.to(DT))
        fence_async_shared()
        mbarrier.arrive(o_ready, count=1)
        mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def fused_rev_kernel(q_t, k_t, do_t, a_t, dh_t, G, beta, dht, dh0, DD, cu, ends, off, plan, seg_seq, seq_cu, scale, H,
                     HV, K: gl.constexpr, V: gl.constexpr, VT: gl.constexpr, NS: gl.constexpr, DT: gl.constexpr,
                     USE_DHT: gl.constexpr, USE_INIT: gl.constexpr, WARM: gl.constexpr, CARRY: gl.constexpr,
                     R_COPY: gl.constexpr, R_DELTA: gl.constexpr, R_LOCAL: gl.constexpr):
    """One program per (sequence, value head, value tile) over tokens [cu[i_n], ends[i_n]) (a slice
    of the sequence where the caller cuts the pass: chunk_bwd.backward), last chunk first: V the
    head's value width (the row length of do, DD, dht, dh0, dh), VT the program's tile of it (V a
    multiple of VT; NVT = V / VT tiles a head), program id (i_n · HV + i_hv) · NVT + i_vt, so the
    value tiles of one head, which copy the same q, k and T tiles and form the same Pᵀ, are
    neighbours. Descriptors: q_t, k_t of [T, H · K] in [64, K] blocks; do_t of [T, HV · V] in
    [64, VT] blocks; a_t (T, kkt_solve's Ai) of [T, HV · 64] in [64, 64] blocks; dh_t of
    [chunks · HV · K, V] in [K, VT] blocks (the program's chunks from off[i_n] on). G [T, HV] the
    in-chunk cumulative log decay γ; beta [T, HV] fp32; dht, dh0 [N, HV, K, V] fp32 (may be one
    tensor: a program reads its own [K, VT] tile first and writes it last); DD [T, HV, V].
    ``WARM``: the programs are warm-started segments (seg_seq their sequences, seq_cu the
    sequences' bounds, plan [NS, HV] the warm-up chunks after each: split.warm_plan with ``after``,
    one count per segment and head, shared by the head's value tiles), each starting from a zero dS
    that many chunks after its end (from dht where that reaches the sequence's end), as
    state_bwd_kernel's ``WARM`` form; dht and dh0 are then per sequence (with ``CARRY``, dh0 per
    program: the dS entering each, which a sliced pass's later slices start from). R_*: the registers a
    thread of the copy, δ and local partitions holds (the state's partition takes the rest of the
    launch's ``maxnreg`` budget)."""
    NVT: gl.constexpr = V // VT
    i_n, i_hv, i_h, col = _program(H, HV, NVT, VT)
    ring_q = gl.allocate_shared_memory(DT, [NS, BT, K], q_t.layout)
    ring_k = gl.allocate_shared_memory(DT, [NS, BT, K], k_t.layout)
    ring_do = gl.allocate_shared_memory(DT, [NS, BT, VT], do_t.layout)
    ring_a = gl.allocate_shared_memory(DT, [NS, BT, BT], a_t.layout)
    p_buf = gl.allocate_shared_memory(DT, [BT, BT], a_t.layout)
    s_buf = gl.allocate_shared_memory(DT, [K, VT], dh_t.layout)
    rows: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, VT], DT)
    l_buf = gl.allocate_shared_memory(DT, [BT, VT], rows)
    d_buf = gl.allocate_shared_memory(DT, [BT, VT], rows)
    z_buf = gl.allocate_shared_memory(DT, [BT, VT], rows)
    o_buf = gl.allocate_shared_memory(DT, [BT, VT], rows)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    hand = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=3)  # the state, δ and local warpgroups
    for i in gl.static_range(8):  # each handed tile has one writer and one reader
        mbarrier.init(hand.index(i), count=1)
    fence_async_shared()
    s_ready, s_empty, l_ready, l_empty = hand.index(0), hand.index(1), hand.index(2), hand.index(3)
    o_ready, o_empty, z_ready, z_empty = hand.index(4), hand.index(5), hand.index(6), hand.index(7)
    gl.warp_specialize([
        (_state, (ring_q, ring_k, ready, empty, s_buf, s_ready, s_empty, o_buf, o_ready, o_empty, z_buf, z_ready,
                  z_empty, G, dht, dh0, dh_t, cu, ends, off, plan, seg_seq, seq_cu, i_n, i_hv, col, HV, K, V, VT,
                  DT, USE_DHT, USE_INIT, WARM, CARRY)),
        (_copies, (q_t, k_t, do_t, a_t, ring_q, ring_k, ring_do, ring_a, ready, empty, cu, ends, plan, seg_seq,
                   seq_cu, i_n, i_h, i_hv, col, HV, K, V, VT, WARM)),
        (_delta, (ring_k, ring_a, ready, empty, s_buf, s_ready, s_empty, l_buf, l_ready, l_empty, d_buf, z_buf,
                  z_ready, z_empty, G, beta, DD, cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, col, HV, V, VT, DT,
                  WARM)),
        (_local, (ring_q, ring_k, ring_do, ready, empty, p_buf, l_buf, l_ready, l_empty, o_buf, o_ready, o_empty, G,
                  cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, scale, VT, DT, WARM)),
    ], [1, WG, WG], [R_COPY, R_DELTA, R_LOCAL])


def usable(q, g, beta, K: int, V: int) -> bool:
    """Whether this pass takes the backward's reverse pass (``DELTA["fused_rev"]["on"]``): gated
    delta member, 16-bit inputs, K of 64 or 128, V of 64, 128 or 256 (256 as two value tiles of 128:
    fused_fwd.value_tile), on a device that runs it (fused_bwd.hopper)."""
    return (bool(DELTA["fused_rev"]["on"]) and g is not None and beta is not None
            and q.dtype in (torch.bfloat16, torch.float16) and K in (64, 128) and V in (64, 128, 256) and hopper(q))


def value_tiles(V: int) -> int:
    """The programs a value head of V columns runs as (NVT: value tiles of fused_fwd.value_tile's
    width), which the callers' split decisions count per head."""
    return V // value_tile(V, "fused_rev")


def plain_tile(V: int, pairs: int, device) -> int:
    """The value tile of an unsplit pass over ``pairs`` (sequence, value head) pairs:
    ``DELTA["fused_rev"]["narrow"]`` where the programs on tiles that narrow still number at most
    the multiprocessors (one program a multiprocessor: one wave), else :func:`value_tiles`' tile.
    The chain's step is latency-bound, so where half the card would idle, twice the programs on
    half the columns each finish the pass sooner (H200, sliced plain pass: (4, 8192, 16, 128) 506
    → 375 µs, Qwen3.5-397B 2031 → 1443, the 340m layer 246 → 176), while at more than one wave
    they take longer ((8, 2048) 164 → 207; docs/TRITON.md)."""
    vt, n = value_tile(V, "fused_rev"), DELTA["fused_rev"]["narrow"]
    return n if n and n < vt and V % n == 0 and pairs * (V // n) <= sm_count(device) else vt


def reverse(q, k, do, G, beta, Ai, dht, dh, DD, dh0, cu, ends, off, N: int, scale: float, warm=None):
    """Launch the pass over N programs' token ranges [cu, ends) (per sequence, or a slice of each):
    fills dh [chunks, HV, K, V] (dS_out of each chunk, from off on per program; contiguous, in the
    inputs' dtype), DD [T, HV, V] (dδ) and, when given, dh0 [N, HV, K, V] (fp32; may be ``dht``).
    q, k [T, H, K]; do [T, HV, V]; G (γ), beta [T, HV] fp32; Ai [T, HV, 64]. One program per
    (range, value head, value tile of fused_fwd.value_tile: N · HV · NVT in all). ``warm``: (plan,
    seg_seq, seq_cu) where the programs are warm-started segments (the kernel's ``WARM``; dht and
    dh0 per sequence then; plan per segment and head, shared by the head's value tiles)."""
    reverser(q, k, do, G, beta, Ai, dh, DD, scale)(dht, dh0, cu, ends, off, N, warm)


def reverser(q, k, do, G, beta, Ai, dh, DD, scale: float, VT: int | None = None):
    """:func:`reverse` over these tensors as ``run(dht, dh0, cu, ends, off, N, warm=None, carry=False)``,
    with the tensor descriptors made once for every launch (a sliced backward launches the pass once a
    slice over the same tensors); programs on value tiles of ``VT`` columns (default
    :func:`value_tiles`' tile; :func:`plain_tile` for an unsplit pass). ``carry`` (with ``warm``):
    dh0 [N, HV, K, V] takes the dS entering each program's range (the kernel's ``CARRY``)."""
    T, H, K = k.shape
    HV, V = do.shape[1], do.shape[2]
    VT = value_tile(V, "fused_rev") if VT is None else VT
    c = DELTA["fused_rev"]
    DT = gl.bfloat16 if do.dtype == torch.bfloat16 else gl.float16
    assert dh.is_contiguous() and dh.data_ptr() % 16 == 0  # written through its descriptor in place
    q_t = _tiles(q, T, (CHUNK, K), DT)
    k_t = _tiles(k, T, (CHUNK, K), DT)
    do_t = _tiles(do, T, (CHUNK, VT), DT)
    a_t = _tiles(Ai, T, (CHUNK, CHUNK), DT)
    dh_t = _tiles(dh, dh.numel() // V, (K, VT), DT)
    r = tuple(c["regs"])
    programs = HV * (V // VT)

    def run(dht, dh0, cu, ends, off, N: int, warm=None, carry: bool = False):
        plan, seg_seq, seq_cu = warm if warm is not None else (cu, cu, cu)
        launch(fused_rev_kernel, (N * programs,), q_t, k_t, do_t, a_t, dh_t, G, beta,
               dht if dht is not None else G, dh0 if dh0 is not None else G, DD, cu, ends, off, plan, seg_seq,
               seq_cu, scale, H, HV, K=K, V=V, VT=VT, NS=c["NS"], DT=DT, USE_DHT=dht is not None,
               USE_INIT=dh0 is not None, WARM=warm is not None, CARRY=carry, R_COPY=r[0], R_DELTA=r[1], R_LOCAL=r[2],
               maxnreg=c["maxnreg"], name="fused_rev")

    return run
