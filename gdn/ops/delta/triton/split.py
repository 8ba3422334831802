"""The split state passes: a sequence's chunks cut into segments that run in parallel, so that
few long sequences still fill the card (docs/TRITON.md "Split state passes").

Warm-started (gated members, ``DELTA["split"]["warm"]``): each segment's program starts from a
zero state a bounded number of chunks early (:func:`warm_up`, adding up the chunks' log norm
bounds, made once per call: :func:`bounds`) and reaches the true state within ``log_eps``; the
state kernels' ``WARM`` form. Chained (any member, an explicit ``L`` only): each segment's map
S ↦ A S + B is formed from [I | 0] (the state kernels' ``AUG`` form), then :func:`chain` walks the
maps in order, then each segment runs from its true entering state. :func:`split_len` decides the segment length.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...triton.common import BT, INTERPRET, Chunks, chunk_bounds, fill_empty, launch, pow2, sm_count
from ...tuning import DELTA, cdiv


@triton.jit
def bound_kernel(k, beta, G, Bnd, cu, chunk_idx, H, HV, K: tl.constexpr, BT: tl.constexpr):
    """Bnd[i_t, hv] = the log of a bound on the norm of chunk i_t's state map S ↦ A S (the reverse
    pass's dS ↦ Aᵀ dS has the same norm), for the gated delta members: γ_C (Σ_t g_t over the chunk)
    plus Σ_t log max(1, |1 − β_t‖k_t‖²|) (the norm of I − β k kᵀ: 0 for unit keys with β ≤ 2). For a
    call whose in-chunk inverse was made elsewhere: kkt_solve stores the same bounds as it forms T⁻¹
    (``STORE_B``), which is where the forward's come from."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    _, t0, eos = chunk_bounds(cu, chunk_idx, i_t, BT)
    rows = t0 + tl.arange(0, BT)
    m = rows < eos
    b_k = tl.load(k + (rows[:, None] * H + i_h) * K + tl.arange(0, K)[None, :], mask=m[:, None], other=0.0)
    nk = tl.sum(b_k.to(tl.float32) * b_k.to(tl.float32), axis=1)
    b_b = tl.load(beta + rows * HV + i_hv, mask=m, other=0.0).to(tl.float32)
    b = tl.load(G + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv)
    b += tl.sum(tl.log(tl.maximum(tl.abs(1.0 - b_b * nk), 1.0)), axis=0)
    tl.store(Bnd + i_t * HV + i_hv, b)


def bounds(k, beta, G, ch: Chunks, HV: int, plans=None):
    """The chunks' log norm bounds Bnd [NT, HV] fp32 that the warm-started split's walks read (gated
    delta members; None for the others, whose walks read γ): ``plans["bound"]``, kkt_solve's, when
    the forward left them there, else made by :func:`bound_kernel` (and left there)."""
    if G is None or beta is None:
        return None
    b = None if plans is None else plans.get("bound")
    if b is None:
        T, H, K = k.shape
        b = torch.empty(ch.NT, HV, device=k.device, dtype=torch.float32)
        launch(bound_kernel, (ch.NT, HV), k, beta, G, b, ch.cu, ch.chunk_idx, H, HV, K=K, BT=BT, name="bound")
        if plans is not None:
            plans["bound"] = b
    return b


@triton.jit
def _bound_at(Bnd, G, c, j, m, bos, eos, seos, i_hv, HV, BT: tl.constexpr, DELTA: tl.constexpr,
              AFTER: tl.constexpr):
    """The log norm bound of the j-th chunk a walk takes (global chunk c; j and c scalars or
    vectors, m their mask): Bnd's for the delta members, else γ_C, G at the chunk's last row (the
    j-th chunk after the segment's end ``eos``, or before its start ``bos``; ``seos`` its
    sequence's end); 0 where m is false."""
    if DELTA:
        b = tl.load(Bnd + c * HV + i_hv, mask=m, other=0.0)
    else:
        last = tl.minimum(eos + (j + 1) * BT, seos) - 1 if AFTER else bos - j * BT - 1
        b = tl.load(G + last * HV + i_hv, mask=m, other=0.0)
    return b


@triton.jit
def warm_up(Bnd, G, seg_seq, seq_cu, seq_off, i_s, bos, eos, i_hv, HV, BT: tl.constexpr, DELTA: tl.constexpr,
            LOG_EPS: tl.constexpr, AFTER: tl.constexpr, NB: tl.constexpr = 1):
    """(sequence, its first row, its end, warm-up chunks) of segment ``i_s`` = rows [bos, eos) of a
    ``WARM`` state pass (of sequence seg_seq[i_s], whose rows seq_cu bounds and whose first chunk is
    the call's chunk seq_off[seg_seq[i_s]]: Chunks.chunk_off): whole chunks walked from the
    segment's first row back (``AFTER``: from its end forward, the reverse pass's warm-up), adding up
    each chunk's log norm bound (:func:`bound_kernel`), until the sum falls to ``LOG_EPS`` or the
    walk reaches the sequence's edge. The bounds come from Bnd [NT, HV] (delta members: kkt_solve's or
    :func:`bound_kernel`'s), else they are γ_C, G at each chunk's last row. With NB > 1, NB chunks'
    bounds are read at once and the walk's stop found in their running sum (warm_plan_kernel: a
    walk of n chunks waits on ⌈n / NB⌉ loads, not n); NB = 1 reads one bound a step (the state
    passes' own walks: there the block's scan and reductions raise the whole kernel's registers,
    ptxas sm_90 bf16 at 1 × 32768: state_bwd's WARM form 255 registers and 76 + 72 B of spills at
    three stages with NB = 16, 253 and none with NB = 1)."""
    i_seq = tl.load(seg_seq + i_s)
    sbos = tl.load(seq_cu + i_seq).to(tl.int64)
    seos = tl.load(seq_cu + i_seq + 1).to(tl.int64)
    c_seq = tl.load(seq_off + i_seq).to(tl.int64)
    if AFTER:
        avail = tl.cdiv(seos - eos, BT)
        step = 1
        c1 = c_seq + tl.cdiv(eos - sbos, BT)  # the first chunk after the segment
    else:
        avail = (bos - sbos) // BT
        step = -1
        c1 = c_seq + (bos - sbos) // BT - 1  # the last chunk before it
    if NB == 1:
        nw = 0
        acc = 0.0
        while (acc > LOG_EPS) & (nw < avail):
            acc += _bound_at(Bnd, G, c1 + step * nw, nw, True, bos, eos, seos, i_hv, HV, BT, DELTA, AFTER)
            nw += 1
    else:
        o_j = tl.arange(0, NB)
        nw = avail * 0
        acc = 0.0
        go = (avail > 0) & (LOG_EPS < 0.0)  # (a bound of e^0 or more is met before any chunk)
        while go:
            j = nw + o_j
            m = j < avail
            b = _bound_at(Bnd, G, c1 + step * j, j, m, bos, eos, seos, i_hv, HV, BT, DELTA, AFTER)
            hit = m & (acc + tl.cumsum(b, axis=0) <= LOG_EPS)
            stop = tl.min(tl.where(hit, j, avail), axis=0)  # the first chunk whose bound closes the walk
            nw = tl.where(stop < avail, stop + 1, tl.minimum(nw + NB, avail))
            acc += tl.sum(b, axis=0)
            go = (stop >= avail) & (nw < avail)
    return i_seq, sbos, seos, nw


@triton.jit
def warm_plan_kernel(Bnd, G, cu, seg_seq, seq_cu, seq_off, nw_out, HV, BT: tl.constexpr, DELTA: tl.constexpr,
                     LOG_EPS: tl.constexpr, AFTER: tl.constexpr):
    """For each segment and value head (program (s, hv)): the warm-up chunks :func:`warm_up` walks
    back before the segment (``AFTER``: forward after it, the reverse pass's), into nw_out [NS, HV]
    (int32), for a pass that takes them from memory (delta.triton.fused_fwd and fused_rev, whose
    roles all need the count before they start)."""
    i_s, i_hv = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu + i_s).to(tl.int64)
    eos = tl.load(cu + i_s + 1).to(tl.int64)
    _, _, _, nw = warm_up(Bnd, G, seg_seq, seq_cu, seq_off, i_s, bos, eos, i_hv, HV, BT, DELTA, LOG_EPS, AFTER, 16)
    tl.store(nw_out + i_s * HV + i_hv, nw)


def warm_plan(Bnd, G, sg, ch: Chunks, HV: int, after: bool = False):
    """nw [NS, HV] int32: :func:`warm_plan_kernel` over segments ``sg`` of the sequences ``ch``
    (gated members: the passes that take the counts from memory run only those; ``Bnd`` the chunks'
    bounds of a delta member, :func:`bounds`, None for the others; ``after``: the reverse pass's
    warm-up, after each segment)."""
    nw = torch.empty(sg.NS, HV, device=G.device, dtype=torch.int32)
    launch(warm_plan_kernel, (sg.NS, HV), Bnd if Bnd is not None else G, G, sg.cu, sg.seq, ch.cu, ch.chunk_off, nw,
           HV, BT=BT, DELTA=Bnd is not None, LOG_EPS=float(DELTA["split"]["log_eps"]), AFTER=after, name="warm_plan")
    return nw


@triton.jit
def _chain_step(j, b_s, X, Sseg, s0, ns, i_hv, HV, o_k, o_v, mv, K: tl.constexpr, V: tl.constexpr,
                BC: tl.constexpr, REVERSE: tl.constexpr, PREC: tl.constexpr):
    """Store the state entering segment j of the walk, then apply its map: S ← A S + B."""
    valid = j < ns
    seg = s0 + (ns - 1 - j if REVERSE else j)
    base = (seg * HV + i_hv).to(tl.int64)
    NV: tl.constexpr = K + V
    tl.store(Sseg + base * K * V + o_k[:, None] * V + o_v[None, :], b_s, mask=mv[None, :] & valid)
    tl.debug_barrier()  # the blocks of S read back below were written by other threads
    b_n = tl.load(X + base * K * NV + o_k[:, None] * NV + K + o_v[None, :], mask=mv[None, :] & valid, other=0.0)
    o_c = tl.arange(0, BC)
    for kk in tl.static_range(K // BC):
        b_a = tl.load(X + base * K * NV + o_k[:, None] * NV + kk * BC + o_c[None, :], mask=valid, other=0.0)
        b_p = tl.load(Sseg + base * K * V + (kk * BC + o_c)[:, None] * V + o_v[None, :],
                      mask=mv[None, :] & valid, other=0.0)
        b_n += tl.dot(b_a, b_p, input_precision=PREC)
    tl.debug_barrier()  # every thread has read S before the next step overwrites nothing it needs
    return tl.where(valid, b_n, b_s)


@triton.jit(do_not_specialize=['max_ns'])
def chain_kernel(X, S0, Sseg, Sfin, first, count, max_ns, HV, K: tl.constexpr, V: tl.constexpr,
                 BV: tl.constexpr, BC: tl.constexpr, REVERSE: tl.constexpr, USE_S0: tl.constexpr,
                 STORE_FIN: tl.constexpr, PREC: tl.constexpr, WHILE: tl.constexpr):
    """Second phase of a split state pass, one program per (sequence, value head, V tile): walk the
    sequence's segments in order (``REVERSE``: last to first), store the state entering each in
    Sseg [NS, HV, K, V] and apply the segment's map S ← A S + B from X [NS, HV, K, K + V] = [A | B];
    the state after the last segment goes to Sfin [N, HV, K, V]. S starts from S0 (or zero)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    s0 = tl.load(first + i_n)
    ns = tl.load(count + i_n)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    mv = o_v < V
    p_n = (i_n * HV + i_hv).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.zeros([K, BV], dtype=tl.float32)
    if USE_S0:
        b_s = tl.load(S0 + p_n, mask=mv[None, :], other=0.0).to(tl.float32)
    if WHILE:
        j = 0
        while j < max_ns:
            b_s = _chain_step(j, b_s, X, Sseg, s0, ns, i_hv, HV, o_k, o_v, mv, K, V, BC, REVERSE, PREC)
            j += 1
    else:
        for j in range(0, max_ns):
            b_s = _chain_step(j, b_s, X, Sseg, s0, ns, i_hv, HV, o_k, o_v, mv, K, V, BC, REVERSE, PREC)
    if STORE_FIN:
        tl.store(Sfin + p_n, b_s, mask=mv[None, :])


def chain(X, S0, Sfin, sg, HV: int, K: int, V: int, reverse: bool, prec: str):
    """Run :func:`chain_kernel`: returns Sseg [NS, HV, K, V] fp32 (the state entering each segment
    in the walk's direction); writes the state after the walk into ``Sfin`` when it is given."""
    Sseg = torch.empty(sg.NS, HV, K, V, device=X.device, dtype=torch.float32)
    N = sg.first.numel()
    BV = min(pow2(V), max(16, DELTA["chain"]["SV"] // K))
    launch(chain_kernel, (cdiv(V, BV), N * HV), X, S0 if S0 is not None else X, Sseg,
           Sfin if Sfin is not None else X, sg.first, sg.count, sg.max_ns, HV, K=K, V=V, BV=BV,
           BC=min(K, DELTA["chain"]["BC"]), REVERSE=reverse, USE_S0=S0 is not None, STORE_FIN=Sfin is not None,
           PREC=prec, WHILE=INTERPRET, name="chain")
    return Sseg


def warm_split(g) -> bool:
    """Whether a split state pass takes the warm-started form (``DELTA["split"]["warm"]``; gated
    members only: without a decay nothing bounds how far a segment must walk back)."""
    return g is not None and bool(DELTA["split"]["warm"])


def split_len(ch: Chunks, HV: int, tiles: int, device, warm: bool = True, per_sm: float | None = None) -> int:
    """Chunks per segment of a split state pass, 0 for no split. ``DELTA["split"]["L"]``: 0 never
    splits, a positive number always splits into segments of that many chunks, -1 ("auto") splits
    a ``warm``-started pass (the chained split is never chosen by itself: slower on the H200) when
    the (sequence, head, tile) programs of the longest sequences (``Chunks.long_sequences``: those
    still running at the pass's end) number fewer than ``fill`` times the card's multiprocessors,
    into as many segments as keep the programs within ``per_sm`` per multiprocessor (one wave: a
    second wave of long programs doubles the pass; ``per_sm`` overrides the setting's, for a pass
    whose program fills a multiprocessor)."""
    c = DELTA["split"]
    L = c["L"]
    if L >= 0:
        return L if L and ch.max_nc > L else 0
    sms = sm_count(device)
    programs = ch.long_sequences * HV * tiles
    if not warm or programs >= c["fill"] * sms or ch.max_nc < 2 * c["min_L"]:
        return 0
    parts = int((c["per_sm"] if per_sm is None else per_sm) * sms) // programs
    return 0 if parts < 2 else max(c["min_L"], cdiv(ch.max_nc, parts))
