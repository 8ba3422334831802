"""The forward's sequential pass of the gated delta rule as one warp-specialised Gluon kernel
(``DELTA["fused_fwd"]``): the work of chunk_fwd's ``state_out_kernel`` (δ from the in-chunk
inverse, the pair matrix formed beside the chain) for 16-bit inputs on compute capability 9, one
program per (sequence, value head, value tile) holding a [K, VT] column tile of the state; without
its output, the backward's recomputed state pass (``DELTA["fused_states"]``, storing h and δ).

The value columns of the rule are independent: X, δ, the output and the update of one value column
read no other column of S, V or δ. So a head of V columns runs as NVT = V / VT programs of
VT = min(V, 128) columns each (V = 256: two; the whole [K, 256] state and its tiles would need
about 96 KB more shared memory than a multiprocessor has). Each reads its own columns of v, h0
and writes its own of o, ht, h and δ; the q, k and T⁻¹ tiles and the pair matrix P are the same
for every value tile of a head, copied and formed again by each program.

The pass is a chain: each chunk's products need the state the previous chunk left. Per chunk,
from the entering state S (S, V, δ, O: the program's VT columns):

    X = K S,  δ = T⁻¹ diag(β)(V − diag(Γ) X)            (the chain)
    O = scale · (diag(Γ) Q S + P δ)                      (beside it)
    S ← Γ_C S + Kᵀ diag(Γ_C / Γ) δ                       (the chain)

Four roles run side by side in one program, each in warps of its own, handing tiles through
shared memory and mbarriers:

- the state warpgroup (the default partition) holds S in fp32 registers as the accumulator of its
  own update; per chunk it writes S in 16 bits to shared memory, then waits for δ̃ = diag(Γ_C/Γ) δ
  and adds Kᵀ δ̃ onto Γ_C S;
- the δ warpgroup forms X = K S, Y = diag(β)(V − diag(Γ) X) (through shared memory) and δ = T⁻¹ Y,
  and writes δ and δ̃;
- the output warpgroup forms the pair matrix P = Q Kᵀ ⊙ D and diag(Γ) Q S, adds P δ and stores
  the chunk's output rows;
- one copy warp fills a ring of ``NS`` slots with each chunk's q, k, v and T⁻¹ tiles by tensor
  copies, as soon as the three warpgroups have released the slot.

So the chain is three products (X, δ, the update) and the output's three run beside it, as does
the next chunk's copy. The arithmetic and roundings are state_out_kernel's ``FROM_INV`` +
``PRE_P`` form (its pair matrix as kkt_solve forms it: the fp32 product masked and rounded to the
input dtype): S and Y rounded to the input dtype as MMA operands, δ rounded once, then scaled and
rounded again for the update.

Gluon does not run under Triton's interpreter: the GPU tests check it (tests/gpu/test_fused_fwd.py);
the CPU tests compile it for sm_90 (tools/gluon_budget.py).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ...triton.common import BT as CHUNK
from ...triton.common import make_segments, state_rows
from ...triton.launch import launch
from ...tuning import DELTA
from .fused_bwd import _rows, _tiles, acc_layout, hopper
from .split import bounds, fill_empty, split_len, warm_plan, warm_split

BT = gl.constexpr(CHUNK)
WG = gl.constexpr(4)  # warps of a warpgroup: each role but the copies'


@gluon.jit
def _bounds(cu, i_n, i_hv, HV, plan, WARM: gl.constexpr):
    """(first row, end, warm-up chunks, chunks in all) of program (i_n, i_hv): the warm-up chunks
    (``WARM``: plan [NS, HV], whole chunks before the segment) come first, then the segment's own.
    Every row of a warm-up chunk lies before the segment's start, so masking rows by the end holds
    for both."""
    bos = gl.load(cu + i_n)
    eos = gl.load(cu + i_n + 1)
    nw = 0
    if WARM:
        nw = gl.load(plan + i_n * HV + i_hv)
    return bos - nw * BT, eos, nw, nw + (eos - bos + BT - 1) // BT


@gluon.jit
def _program(H, HV, NVT: gl.constexpr, VT: gl.constexpr):
    """(sequence or segment i_n, value head i_hv, its key head i_h, first value column of the head)
    of this program, the grid being (sequence or segment, value head, value tile of VT columns)."""
    pid = gl.program_id(0)
    i_nh = pid // NVT
    i_hv = i_nh % HV
    return i_nh // HV, i_hv, i_hv // (HV // H), (pid % NVT) * VT


@gluon.jit
def _edges(seg_seq, seq_cu, i_n, bos, eos, WARM: gl.constexpr):
    """(sequence, whether the walk starts at its first row, whether it ends at its end) of program
    i_n walking rows [bos, eos): itself and both where the programs are whole sequences (not
    ``WARM``), else those of its segment's sequence seg_seq[i_n] (bounded by seq_cu)."""
    i_seq = i_n
    at_start = True
    at_end = True
    if WARM:
        i_seq = gl.load(seg_seq + i_n)
        at_start = bos == gl.load(seq_cu + i_seq)
        at_end = eos == gl.load(seq_cu + i_seq + 1)
    return i_seq, at_start, at_end


@gluon.jit
def _copies(q_t, k_t, v_t, a_t, ring_q, ring_k, ring_v, ring_a, ready, empty, cu, plan, i_n, i_h, i_hv, col,
            HV, K: gl.constexpr, V: gl.constexpr, VT: gl.constexpr, WARM: gl.constexpr, OUT: gl.constexpr):
    """The copy warp: chunk c's tiles into slot c % NS once the slot's readers released it (q only
    with the output; of v the program's VT columns from the head's column ``col``)."""
    NS: gl.constexpr = ring_k.shape[0]
    if OUT:
        nbytes: gl.constexpr = (2 * BT * K + BT * VT + BT * BT) * 2
    else:
        nbytes: gl.constexpr = (BT * K + BT * VT + BT * BT) * 2
    bos, eos, nw, nc = _bounds(cu, i_n, i_hv, HV, plan, WARM)
    for c in range(nc):
        s = c % NS
        mbarrier.wait(empty.index(s), ((c // NS) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        bar = ready.index(s)
        t0 = bos + c * BT
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(k_t, [t0, i_h * K], bar, ring_k.index(s))
        tma.async_copy_global_to_shared(v_t, [t0, i_hv * V + col], bar, ring_v.index(s))
        tma.async_copy_global_to_shared(a_t, [t0, i_hv * BT], bar, ring_a.index(s))
        if OUT:
            tma.async_copy_global_to_shared(q_t, [t0, i_h * K], bar, ring_q.index(s))


@gluon.jit
def _state(ring_k, ready, empty, s_buf, s_ready, s_empty, dt_buf, d_ready, d_empty, G, h0, ht, h_t, off, cu, plan,
           seg_seq, seq_cu, i_n, i_hv, col, HV, K: gl.constexpr, V: gl.constexpr, VT: gl.constexpr,
           DT: gl.constexpr, USE_INIT: gl.constexpr, STORE_FINAL: gl.constexpr, WARM: gl.constexpr,
           STORE_H: gl.constexpr):
    """The state warpgroup: S [K, VT] (the head's [K, V] state's value columns from ``col``) in fp32
    registers, published in 16 bits per chunk, updated by Kᵀ δ̃ onto Γ_C S. ``WARM``: program i_n
    is a segment of sequence seg_seq[i_n] (tokens bounded by seq_cu); it starts from h0 only where
    its warm-up reaches the sequence's start and stores the final state only if it ends the
    sequence. ``STORE_H``: the 16-bit S entering each of the program's own chunks is also copied
    out to h (descriptor h_t of [chunks · HV · K, V] in [K, VT] blocks, the chunk's global index
    off[i_n] + its index in the program's own chunks)."""
    NS: gl.constexpr = ring_k.shape[0]
    l_s: gl.constexpr = acc_layout(VT, WG)
    bos, eos, nw, nc = _bounds(cu, i_n, i_hv, HV, plan, WARM)
    i_seq, at_start, at_end = _edges(seg_seq, seq_cu, i_n, bos, eos, WARM)
    o_k = gl.arange(0, K, layout=gl.SliceLayout(1, l_s))
    o_v = col + gl.arange(0, VT, layout=gl.SliceLayout(0, l_s))
    base = (i_seq * HV + i_hv).to(gl.int64) * K * V  # (the [K, VT] offsets are formed where used: held
    # across the loop they would take registers the state's accumulator needs)
    if USE_INIT:
        b_s = gl.load(h0 + base + o_k[:, None] * V + o_v[None, :], mask=(o_k < K)[:, None] & at_start, other=0.0)
    else:
        b_s = gl.zeros([K, VT], gl.float32, l_s)
    for c in range(nc):
        s = c % NS
        par = c & 1
        mbarrier.wait(s_empty, par ^ 1)  # the readers are done with the previous chunk's S
        if STORE_H:
            tma.store_wait(0)  # and so is the copy of it out to h
        s_buf.store(b_s.to(DT))
        fence_async_shared()
        mbarrier.arrive(s_ready, count=1)
        if STORE_H:
            if c >= nw:
                tma.async_copy_shared_to_global(h_t, [((gl.load(off + i_n) + c - nw) * HV + i_hv) * K, col], s_buf)
        last = gl.minimum(eos, bos + (c + 1) * BT) - 1
        b_gc = gl.exp(gl.load(G + last * HV + i_hv))
        mbarrier.wait(ready.index(s), (c // NS) & 1)
        mbarrier.wait(d_ready, par)
        b_s = warpgroup_mma(ring_k.index(s).permute((1, 0)), dt_buf, b_s * b_gc, is_async=True)
        b_s = warpgroup_mma_wait(0, deps=[b_s])
        mbarrier.arrive(d_empty, count=1)
        mbarrier.arrive(empty.index(s), count=1)
    if STORE_FINAL:
        gl.store(ht + base + o_k[:, None] * V + o_v[None, :], b_s, mask=(o_k < K)[:, None] & at_end)
    if STORE_H:
        tma.store_wait(0)


@gluon.jit
def _delta(ring_k, ring_v, ring_a, ready, empty, s_buf, s_ready, s_empty, y_buf, d_buf, dt_buf, d_ready, d_empty, G,
           beta, VN, cu, plan, i_n, i_hv, col, HV, V: gl.constexpr, VT: gl.constexpr, DT: gl.constexpr,
           WARM: gl.constexpr, STORE_H: gl.constexpr):
    """The δ warpgroup, on the program's VT value columns: X = K S, Y = diag(β)(V − diag(Γ) X),
    δ = T⁻¹ Y (zero on rows past the sequence), δ̃ = diag(Γ_C / Γ) δ. ``STORE_H``: δ of the
    program's own chunks also goes to its columns of VN [T, HV, V] (on the sequence's rows)."""
    NS: gl.constexpr = ring_k.shape[0]
    l_v: gl.constexpr = acc_layout(VT, WG)
    r_v: gl.constexpr = gl.SliceLayout(1, l_v)
    st: gl.constexpr = _rows(VT, WG)
    bos, eos, nw, nc = _bounds(cu, i_n, i_hv, HV, plan, WARM)
    o_t = gl.arange(0, BT, layout=r_v)
    o_to = gl.arange(0, BT, layout=gl.SliceLayout(1, st))
    o_vo = col + gl.arange(0, VT, layout=gl.SliceLayout(0, st))  # (the offset folded in: see _output)
    zero = gl.zeros([BT, VT], gl.float32, l_v)
    for c in range(nc):
        s = c % NS
        par = c & 1
        t0 = bos + c * BT
        rt = t0 + o_t
        m = rt < eos
        last = gl.minimum(eos, t0 + BT) - 1
        g_t = gl.load(G + rt * HV + i_hv, mask=m, other=0.0)
        b_b = gl.load(beta + rt * HV + i_hv, mask=m, other=0.0)
        g_last = gl.load(G + last * HV + i_hv)
        mbarrier.wait(ready.index(s), (c // NS) & 1)
        mbarrier.wait(s_ready, par)
        b_x = warpgroup_mma(ring_k.index(s), s_buf, zero, use_acc=False, is_async=True)
        b_x = warpgroup_mma_wait(0, deps=[b_x])
        mbarrier.arrive(s_empty, count=1)
        b_v = ring_v.index(s).load(l_v).to(gl.float32)
        y_buf.store(((b_v - b_x * gl.exp(g_t)[:, None]) * b_b[:, None]).to(DT))
        fence_async_shared()
        b_d = warpgroup_mma(ring_a.index(s), y_buf, zero, use_acc=False, is_async=True)
        b_d = warpgroup_mma_wait(0, deps=[b_d])
        mbarrier.arrive(empty.index(s), count=1)
        b_d = gl.where(m[:, None], b_d, 0.0).to(DT)
        b_w = gl.where(m, gl.exp(g_last - g_t), 0.0)
        if STORE_H:
            if c >= nw:
                ro = t0 + o_to
                p_d = (ro.to(gl.int64)[:, None] * HV + i_hv) * V + o_vo[None, :]
                gl.store(VN + p_d, gl.convert_layout(b_d, st), mask=(ro < eos)[:, None])
        mbarrier.wait(d_empty, par ^ 1)  # the previous δ and δ̃ are consumed
        d_buf.store(b_d)
        dt_buf.store((b_d.to(gl.float32) * b_w[:, None]).to(DT))
        fence_async_shared()
        mbarrier.arrive(d_ready, count=1)


@gluon.jit
def _output(ring_q, ring_k, ready, empty, s_buf, s_ready, s_empty, p_buf, d_buf, d_ready, d_empty, G, o, cu, plan,
            i_n, i_hv, col, HV, scale, V: gl.constexpr, VT: gl.constexpr, DT: gl.constexpr, WARM: gl.constexpr):
    """The output warpgroup: O = scale · (diag(Γ) Q S + P δ) on the program's VT value columns,
    stored on the sequence's rows, with the pair matrix P = Q Kᵀ ⊙ D (D_ij = exp(γ_i − γ_j) for
    i ≥ j, else 0) formed from the chunk's q and k tiles while the chain forms δ (into its own
    shared-memory tile, the last product's left operand). On a warm-up chunk it only passes the
    handshakes (its arrivals count on every barrier)."""
    NS: gl.constexpr = ring_q.shape[0]
    l_v: gl.constexpr = acc_layout(VT, WG)
    r_v: gl.constexpr = gl.SliceLayout(1, l_v)
    l_t: gl.constexpr = acc_layout(BT, WG)
    o_r = gl.arange(0, BT, layout=gl.SliceLayout(1, l_t))
    o_c = gl.arange(0, BT, layout=gl.SliceLayout(0, l_t))
    zero_t = gl.zeros([BT, BT], gl.float32, l_t)
    st: gl.constexpr = _rows(VT, WG)
    bos, eos, nw, nc = _bounds(cu, i_n, i_hv, HV, plan, WARM)
    o_t = gl.arange(0, BT, layout=r_v)
    o_to = gl.arange(0, BT, layout=gl.SliceLayout(1, st))
    # the program's columns of the head, its first column folded into the column indices: a separate
    # offset (or a pointer offset by it) held across the loop spills at this partition's registers
    o_vo = col + gl.arange(0, VT, layout=gl.SliceLayout(0, st))
    zero = gl.zeros([BT, VT], gl.float32, l_v)
    for c in range(nc):
        s = c % NS
        par = c & 1
        mbarrier.wait(ready.index(s), (c // NS) & 1)
        if c < nw:
            mbarrier.wait(s_ready, par)
            mbarrier.arrive(s_empty, count=1)
            mbarrier.wait(d_ready, par)
            mbarrier.arrive(d_empty, count=1)
            mbarrier.arrive(empty.index(s), count=1)
        else:
            t0 = bos + c * BT
            rt = t0 + o_t
            g_t = gl.load(G + rt * HV + i_hv, mask=rt < eos, other=0.0)
            # P first: it needs only the copied tiles, not the chain's S
            b_p = warpgroup_mma(ring_q.index(s), ring_k.index(s).permute((1, 0)), zero_t, use_acc=False)
            g_r = gl.load(G + (t0 + o_r) * HV + i_hv, mask=t0 + o_r < eos, other=0.0)
            g_c = gl.load(G + (t0 + o_c) * HV + i_hv, mask=t0 + o_c < eos, other=0.0)
            keep = o_r[:, None] >= o_c[None, :]
            b_p = b_p * gl.exp(gl.where(keep, g_r[:, None] - g_c[None, :], float("-inf")))
            p_buf.store(b_p.to(DT))
            fence_async_shared()
            mbarrier.wait(s_ready, par)
            b_o = warpgroup_mma(ring_q.index(s), s_buf, zero, use_acc=False)
            mbarrier.arrive(s_empty, count=1)
            mbarrier.wait(d_ready, par)
            b_o = warpgroup_mma(p_buf, d_buf, b_o * gl.exp(g_t)[:, None], is_async=True)
            b_o = warpgroup_mma_wait(0, deps=[b_o])
            mbarrier.arrive(d_empty, count=1)
            mbarrier.arrive(empty.index(s), count=1)
            ro = t0 + o_to
            p_o = (ro.to(gl.int64)[:, None] * HV + i_hv) * V + o_vo[None, :]
            gl.store(o + p_o, gl.convert_layout((b_o * scale).to(o.dtype.element_ty), st), mask=(ro < eos)[:, None])


@gluon.jit
def fused_fwd_kernel(q_t, k_t, v_t, a_t, h_t, G, beta, h0, o, VN, ht, cu, off, plan, seg_seq, seq_cu, scale, H,
                     HV, K: gl.constexpr, V: gl.constexpr, VT: gl.constexpr, NS: gl.constexpr, DT: gl.constexpr,
                     USE_INIT: gl.constexpr, STORE_FINAL: gl.constexpr, WARM: gl.constexpr, OUT: gl.constexpr,
                     STORE_H: gl.constexpr, R_COPY: gl.constexpr, R_DELTA: gl.constexpr, R_OUT: gl.constexpr):
    """One program per (sequence, value head, value tile), walking the sequence's chunks: V the
    head's value width (the row length of v, o, VN, h0, ht, h), VT the program's tile of it (V a
    multiple of VT; NVT = V / VT tiles a head), program id (i_n · HV + i_hv) · NVT + i_vt, so the
    value tiles of one head, which copy the same q, k and T⁻¹ tiles, are neighbours. Descriptors:
    q_t, k_t of [T, H · K] in [64, K] blocks; v_t of [T, HV · V] in [64, VT] blocks; a_t (T⁻¹ rows,
    kkt_solve's Ai) of [T, HV · 64] in [64, 64] blocks. G [T, HV] the in-chunk cumulative log
    decay γ; beta [T, HV] fp32; h0, ht [N, HV, K, V] fp32; o [T, HV, V]. ``WARM``: the programs
    are warm-started segments (cu their bounds, seg_seq their sequences, seq_cu the sequences'
    bounds, plan [NS, HV] their warm-up chunks: split.warm_plan, one count per segment and head that
    its value tiles share, so they walk the same chunks), as state_out_kernel's ``WARM`` form.
    ``OUT``: the output warpgroup runs (else q is not copied and the program is the state pass
    alone). ``STORE_H``: the pass keeps what the backward reads, as state_fwd_kernel does: h
    (descriptor h_t of the [chunks, HV, K, V] states in [K, VT] blocks, the chunk's global index
    off[i_n] + c) and δ in VN [T, HV, V]. R_*: the registers a thread of the copy, δ and output
    partitions holds (the state's partition takes the rest of the launch's ``maxnreg`` budget).

    A chunk's block may reach into the next sequence's rows (or past T, where the copies give
    zeros): β reads 0 there, so Y's rows are 0 and T⁻¹ (lower triangular) keeps the valid rows of δ
    clean; δ is zeroed on those rows before P δ and the state update, and their o rows are not
    stored."""
    NVT: gl.constexpr = V // VT
    i_n, i_hv, i_h, col = _program(H, HV, NVT, VT)
    ring_k = gl.allocate_shared_memory(DT, [NS, BT, K], k_t.layout)
    ring_v = gl.allocate_shared_memory(DT, [NS, BT, VT], v_t.layout)
    ring_a = gl.allocate_shared_memory(DT, [NS, BT, BT], a_t.layout)
    if OUT:
        ring_q = gl.allocate_shared_memory(DT, [NS, BT, K], q_t.layout)
        p_buf = gl.allocate_shared_memory(DT, [BT, BT], a_t.layout)
    else:  # not read
        ring_q = ring_k
        p_buf = ring_a.index(0)
    s_buf = gl.allocate_shared_memory(DT, [K, VT], gl.NVMMASharedLayout.get_default_for([K, VT], DT))
    rows: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, VT], DT)
    y_buf = gl.allocate_shared_memory(DT, [BT, VT], rows)
    d_buf = gl.allocate_shared_memory(DT, [BT, VT], rows)
    dt_buf = gl.allocate_shared_memory(DT, [BT, VT], rows)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    hand = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    readers: gl.constexpr = 2 if OUT else 1  # of S (δ and output warpgroups) and of δ (state and output)
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=readers + 1)  # the state, δ (and output) warpgroups
    mbarrier.init(hand.index(0), count=1)  # S written
    mbarrier.init(hand.index(1), count=readers)  # S read
    mbarrier.init(hand.index(2), count=1)  # δ, δ̃ written
    mbarrier.init(hand.index(3), count=readers)  # δ read
    fence_async_shared()
    s_ready, s_empty, d_ready, d_empty = hand.index(0), hand.index(1), hand.index(2), hand.index(3)
    # (the partitions' functions cannot be bound to names in a Gluon body: each call lists them)
    if OUT:
        gl.warp_specialize([
            (_state, (ring_k, ready, empty, s_buf, s_ready, s_empty, dt_buf, d_ready, d_empty, G, h0, ht, h_t, off,
                      cu, plan, seg_seq, seq_cu, i_n, i_hv, col, HV, K, V, VT, DT, USE_INIT, STORE_FINAL, WARM,
                      STORE_H)),
            (_copies, (q_t, k_t, v_t, a_t, ring_q, ring_k, ring_v, ring_a, ready, empty, cu, plan, i_n, i_h, i_hv,
                       col, HV, K, V, VT, WARM, OUT)),
            (_delta, (ring_k, ring_v, ring_a, ready, empty, s_buf, s_ready, s_empty, y_buf, d_buf, dt_buf, d_ready,
                      d_empty, G, beta, VN, cu, plan, i_n, i_hv, col, HV, V, VT, DT, WARM, STORE_H)),
            (_output, (ring_q, ring_k, ready, empty, s_buf, s_ready, s_empty, p_buf, d_buf, d_ready, d_empty, G, o,
                       cu, plan, i_n, i_hv, col, HV, scale, V, VT, DT, WARM)),
        ], [1, WG, WG], [R_COPY, R_DELTA, R_OUT])
    else:
        gl.warp_specialize([
            (_state, (ring_k, ready, empty, s_buf, s_ready, s_empty, dt_buf, d_ready, d_empty, G, h0, ht, h_t, off,
                      cu, plan, seg_seq, seq_cu, i_n, i_hv, col, HV, K, V, VT, DT, USE_INIT, STORE_FINAL, WARM,
                      STORE_H)),
            (_copies, (q_t, k_t, v_t, a_t, ring_q, ring_k, ring_v, ring_a, ready, empty, cu, plan, i_n, i_h, i_hv,
                       col, HV, K, V, VT, WARM, OUT)),
            (_delta, (ring_k, ring_v, ring_a, ready, empty, s_buf, s_ready, s_empty, y_buf, d_buf, dt_buf, d_ready,
                      d_empty, G, beta, VN, cu, plan, i_n, i_hv, col, HV, V, VT, DT, WARM, STORE_H)),
        ], [1, WG], [R_COPY, R_DELTA])


def usable(q, g, beta, K: int, V: int, name: str = "fused_fwd") -> bool:
    """Whether this pass takes the call (``DELTA[name]["on"]``: ``fused_fwd`` the forward,
    ``fused_states`` the backward's recomputed state pass): gated delta member, 16-bit inputs, K of
    64 or 128, V of 64, 128 or 256 (256 as two value tiles of 128: :func:`value_tile`), on a device
    that runs it (fused_bwd.hopper)."""
    return (bool(DELTA[name]["on"]) and g is not None and beta is not None
            and q.dtype in (torch.bfloat16, torch.float16) and K in (64, 128) and V in (64, 128, 256) and hopper(q))


def value_tile(V: int, name: str = "fused_fwd") -> int:
    """The value columns of one program of pass ``name`` (``fused_fwd``, ``fused_states`` or
    ``fused_rev``): the whole head up to ``DELTA[name]["VT"]`` (64 or 128), else tiles of that width
    (at most 128: a program's [K, 128] state, ring and handed tiles fill a multiprocessor's shared
    memory)."""
    return min(V, DELTA[name]["VT"])


def split_of(ch, HV: int, V: int, device, g, name: str = "fused_states") -> int:
    """The segment length of this pass's warm-started split (0: whole sequences): where its (sequence,
    value head, value tile) programs would leave multiprocessors idle, counting every value tile, at
    one program a multiprocessor (this program's shared memory takes the whole of one)."""
    return split_len(ch, HV, V // value_tile(V, name), device, per_sm=1) if warm_split(g) else 0


def _run(k, v, G, beta, Ai, h0, ht, ch, *, q=None, o=None, scale=1.0, h=None, VN=None, plans=None, pad=0, pad_L=0):
    """Launch the pass: with ``o`` the forward (q and scale given; fills o), else the state
    pass alone filling h [NT, HV, K, V] and VN [T, HV, V]; ht [N, HV, K, V] when given. One program
    per (sequence, value head, value tile of :func:`value_tile`); where those programs would leave
    multiprocessors idle, the sequences run as warm-started segments (split.split_len counting every
    value tile, at one program a multiprocessor: this program's shared memory takes the whole of
    one), each segment's warm-up count per head shared by the head's value tiles. ``plans``: one
    call's chunk bounds (``"bound"``, split.bounds) and warm-up counts by segment length (a dict the
    forward fills and its backward's state pass reads: the same k, β and γ walk to the same counts),
    or None. ``pad``, ``pad_L``: h's rows as common.state_rows lays them out with those pads."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    out = o is not None
    name = "fused_fwd" if out else "fused_states"
    c = DELTA[name]
    VT = value_tile(V, name)
    NVT = V // VT
    L = split_of(ch, HV, V, v.device, G, name)
    programs, cu, plan, seg_seq = ch.N, ch.cu, ch.cu, ch.cu
    off = state_rows(ch, pad, v.device, L, pad_L)[0]  # where each program's chunks' states go in h
    if L:
        sg = make_segments(ch, L, v.device)
        programs, cu, seg_seq = sg.NS, sg.cu, sg.seq
        plan = None if plans is None else plans.get(L)
        if plan is None:
            plan = warm_plan(bounds(k, beta, G, ch, HV, plans), G, sg, ch, HV)
            if plans is not None:
                plans[L] = plan
    DT = gl.bfloat16 if v.dtype == torch.bfloat16 else gl.float16
    k_t = _tiles(k, T, (CHUNK, K), DT)
    v_t = _tiles(v, T, (CHUNK, VT), DT)
    a_t = _tiles(Ai, T, (CHUNK, CHUNK), DT)
    q_t = _tiles(q, T, (CHUNK, K), DT) if out else k_t
    h_t = _tiles(h, h.numel() // V, (K, VT), DT) if h is not None else k_t
    regs = tuple(c["regs"]) + (0,) * (3 - len(c["regs"]))
    launch(fused_fwd_kernel, (programs * HV * NVT,), q_t, k_t, v_t, a_t, h_t, G, beta,
           h0 if h0 is not None else G, o if out else G, VN if VN is not None else G, ht if ht is not None else G, cu,
           off, plan, seg_seq, ch.cu, scale, H, HV, K=K, V=V, VT=VT, NS=c["NS"], DT=DT, USE_INIT=h0 is not None,
           STORE_FINAL=ht is not None, WARM=bool(L), OUT=out, STORE_H=h is not None, R_COPY=regs[0],
           R_DELTA=regs[1], R_OUT=regs[2], maxnreg=c["maxnreg"], name=name)
    if L:
        fill_empty(ht, h0, ch)


def forward(q, k, v, G, beta, Ai, h0, o, ht, ch, scale: float, plans=None):
    """The forward: fills o [T, HV, V] and, when ``ht`` is given, the final state. q, k [T, H, K];
    v [T, HV, V] (16-bit); G, beta [T, HV] fp32; Ai [T, HV, 64] from kkt_solve; h0 [N, HV, K, V]
    fp32 or None. ``plans``: as :func:`_run`'s."""
    _run(k, v, G, beta, Ai, h0, ht, ch, q=q, o=o, scale=scale, plans=plans)


def states(k, v, G, beta, Ai, h0, h, VN, ht, ch, plans=None, pad=0, pad_L=0):
    """The backward's recomputed state pass (chunk_fwd.forward_intermediates' ``from_inverse`` form):
    fills h [rows, HV, K, V] (the state entering each chunk, at common.state_rows' rows with ``pad``
    and ``pad_L``) and VN [T, HV, V] (δ) in the inputs' dtype, and ht when given; its warm-up counts
    from ``plans`` where the forward left them."""
    _run(k, v, G, beta, Ai, h0, ht, ch, h=h, VN=VN, plans=plans, pad=pad, pad_L=pad_L)
