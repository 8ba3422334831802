"""Causal softmax attention over a sequence split along T across ranks.

Sliding window W: a query sees at most the W − 1 keys before it, so a rank needs the last W − 1
keys and values of the ranks before it: one halo exchange (:func:`gdn.distributed.halo`, from the
previous rank when every slice holds at least W − 1 tokens). Memory and compute per rank stay
O(T_r · W).

Global attention, two ways (``ContextParallel(..., attention=...)``):

- ``"gather"``: an all-gather of every rank's keys and values (each rank keeps those of the ranks
  up to it), then ``scaled_dot_product_attention`` over query blocks of :data:`QUERY_BLOCK` with an
  explicit mask (causal, same packed sequence). O(T) keys and values per rank, kept for the
  backward; the gradients of the keys and values return to their ranks by a reduce-scatter.
- ``"ring"``: key/value blocks travel rank to rank (:class:`_RingAttention`). Rank r folds in its
  own block, then the blocks of ranks r − 1, r − 2, … as they arrive, down to the first rank that
  holds a key it can see (:meth:`ContextParallel.first_visible_rank`: rank 0 for batch rows, the
  rank where its first token's packed sequence starts otherwise), merging partial results by their
  log-sum-exp. Causality makes it a pipeline rather than a cycle: no rank needs a later rank's
  keys, so rank r receives only the blocks it reads (from r − 1) and passes on those that r + 1
  reads. It holds two key/value blocks at a time and keeps only its own for the backward, which
  runs the same pipeline again: each block travels with the fp32 gradient of its keys and values,
  every rank adds its share, and the last rank to read a block sends the sum straight back to the
  block's owner. Attention inside a block is PyTorch matrix products with fp32 (fp64 for fp64
  inputs) scores, in query chunks of at most :data:`SCORE_BUDGET` scores.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .comm import Transfer, all_gather, halo

__all__ = ["softmax_attention", "ring_plan", "QUERY_BLOCK", "SCORE_BUDGET"]

#: Queries per block of the masked attention.
QUERY_BLOCK = 1024
#: Most scores (batch × heads × queries × keys) one chunk of the ring's block attention holds: the
#: chunk's transient memory is a few times this in fp32.
SCORE_BUDGET = 1 << 25


def softmax_attention(q, k, v, *, cp, scale=None, window_size=None):
    """Causal softmax attention of this rank's queries over every key before them.

    q: [B, T_r, HQ, D]; k: [B, T_r, HKV, D]; v: [B, T_r, HKV, Dv] (this rank's slice, rotary
    embeddings already applied at the global positions); HQ a multiple of HKV. ``cp``: the
    :class:`gdn.distributed.ContextParallel` (its ``cu_seqlens`` keep packed sequences apart);
    ``window_size`` W: query t sees keys t−W+1..t (None: every earlier key). Returns
    o [B, T_r, HQ, Dv] in v.dtype.
    """
    B, T, HQ, D = q.shape
    if T != cp.length:
        raise ValueError(f"this rank holds tokens [{cp.start}, {cp.end}) ({cp.length}) but q has T = {T}")
    scale = D ** -0.5 if scale is None else scale
    if window_size is None and cp.attention == "ring":
        if HQ % k.shape[2]:
            raise ValueError(f"query heads ({HQ}) must be a multiple of key/value heads ({k.shape[2]})")
        with torch.autocast(q.device.type, enabled=False):  # the blocks choose their own precision (fp32 scores)
            return _RingAttention.apply(q, k, v, cp, float(scale))
    s, e = cp.start, cp.end
    kv = torch.cat([k, v.to(k.dtype)], -1)
    if window_size is None:
        kv_all, first = all_gather(kv, cp, upto=cp.rank + 1), 0  # keys [0, e)
    else:
        n = window_size - 1
        kv_all, first = torch.cat([halo(kv, n, cp), kv], 1), s - n  # keys [s − n, e)
    keys, values = kv_all[..., :D], kv_all[..., D:].to(v.dtype)
    qseq = cp.sequence_ids(s, e, q.device)
    kseq = cp.sequence_ids(first, e, q.device)
    outs = []
    for a in range(0, T, QUERY_BLOCK):
        b = min(T, a + QUERY_BLOCK)
        qa, qb = s + a, s + b  # global positions of the block's queries
        lo = max(first, 0, cp.sequence_start(qa) if window_size is None else qa - window_size + 1)
        qpos = torch.arange(qa, qb, device=q.device)[:, None]
        kpos = torch.arange(lo, qb, device=q.device)[None, :]
        allowed = kpos <= qpos
        if window_size is not None:
            allowed &= (qpos - kpos) < window_size
        if qseq is not None:
            allowed &= qseq[a:b, None] == kseq[None, lo - first: qb - first]
        o = F.scaled_dot_product_attention(
            q[:, a:b].transpose(1, 2), keys[:, lo - first: qb - first].transpose(1, 2),
            values[:, lo - first: qb - first].transpose(1, 2), attn_mask=allowed, scale=scale,
            enable_gqa=HQ != keys.shape[2])
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, 1).to(v.dtype)


# ---- ring attention ------------------------------------------------------------------------------

def ring_plan(cp, rank: int | None = None) -> dict:
    """The ring schedule of ``rank`` (default: this rank), the same arithmetic on every rank.

    At step i (0, 1, …) the rank holds the key/value block of rank ``rank − i``. Returns
    ``recv``: how many blocks it receives from ``rank − 1`` (steps 0..recv − 1 post a receive of
    the next one); ``send``: how many of its blocks it passes on to ``rank + 1`` (steps 0..send − 1);
    ``last``: the last rank that reads this rank's block (its keys' gradient comes back from there
    at step ``last − rank``); ``steps``: the number of steps of the backward.
    """
    r = cp.rank if rank is None else rank
    need = [cp.first_visible_rank(j) for j in range(cp.size)]
    recv = r - need[r]
    send = r + 1 - need[r + 1] if r < cp.size - 1 else 0
    last = max(x for x in range(r, cp.size) if need[x] <= r)  # need is non-decreasing in the rank
    return {"recv": recv, "send": send, "last": last, "steps": max(recv, last - r) + 1}


def _pairs(cp, j: int, T: int, rows: int, device):
    """The (query chunk, key range) pairs of this rank's queries against rank j's keys that see at
    least one key: ``(a, b, lo, hi, mask)`` with local query rows [a, b), keys [lo, hi) local to
    block j and ``mask`` [b − a, hi − lo] (causal, same packed sequence). ``rows`` = batch × query
    heads sets the chunk size (at most :data:`SCORE_BUDGET` scores)."""
    s, bj, ej = cp.start, cp.bounds[j], cp.bounds[j + 1]
    step = max(16, min(QUERY_BLOCK, SCORE_BUDGET // max(1, rows * (ej - bj))))
    for a in range(0, T, step):
        b = min(T, a + step)
        lo, hi = max(bj, cp.sequence_start(s + a)), min(ej, s + b)  # keys after a query's sequence start, not after it
        if lo >= hi:
            continue
        qpos = torch.arange(s + a, s + b, device=device)[:, None]
        kpos = torch.arange(lo, hi, device=device)[None, :]
        allowed = kpos <= qpos
        if cp.cu_seqlens is not None:
            allowed &= cp.sequence_ids(s + a, s + b, device)[:, None] == cp.sequence_ids(lo, hi, device)[None, :]
        yield a, b, lo - bj, hi - bj, allowed


def _split_kv(kv, lo, hi, D, cdt):
    """Keys [B, HKV, L, D] and values [B, HKV, L, Dv] of block rows [lo, hi), in ``cdt``."""
    part = kv[:, lo:hi].transpose(1, 2).to(cdt)
    return part[..., :D], part[..., D:]


def _scores(qc, k, mask, scale):
    """Masked scores [B, HKV, G, Lq, Lk] of queries qc [B, HKV, G, Lq, D] against keys [B, HKV, Lk, D]."""
    B, HKV, G, Lq, D = qc.shape
    s = torch.matmul(qc.reshape(B, HKV, G * Lq, D), k.mT).view(B, HKV, G, Lq, -1) * scale
    return s.masked_fill(~mask, float("-inf"))


class _RingAttention(torch.autograd.Function):
    """Global causal attention of this rank's queries over every earlier key, the keys and values
    reaching it block by block (module docstring). q [B, T_r, HQ, D], k [B, T_r, HKV, D],
    v [B, T_r, HKV, Dv] -> o [B, T_r, HQ, Dv] in v.dtype. Query head h reads key/value head
    h // (HQ / HKV). Saves q, k, v, o and the log-sum-exp [B, HQ, T_r] (fp32): O(T_r)."""

    @staticmethod
    def forward(ctx, q, k, v, cp, scale):
        B, T, HQ, D = q.shape
        HKV, Dv = k.shape[2], v.shape[3]
        G, r, cdt = HQ // HKV, cp.rank, torch.promote_types(q.dtype, torch.float32)
        plan = ring_plan(cp)
        qg = q.view(B, T, HKV, G, D).permute(0, 2, 3, 1, 4).to(cdt)  # [B, HKV, G, T, D]
        o = q.new_zeros((B, HKV, G, T, Dv), dtype=cdt)
        lse = q.new_full((B, HKV, G, T), float("-inf"), dtype=cdt)
        cur = torch.cat([k, v.to(k.dtype)], -1)  # the block in hand, [B, T_j, HKV, D + Dv]
        for i in range(plan["recv"] + 1):
            j = r - i
            # post this step's transfers first so that they run while the block is computed
            sends = [(cur, r + 1, 0)] if i < plan["send"] else []
            recvs = [((B, cp.bounds[j] - cp.bounds[j - 1], HKV, D + Dv), cur.dtype, r - 1, 0)] if i < plan["recv"] else []
            transfer = Transfer(sends, recvs, cp.group, q.device)
            for a, b, lo, hi, mask in _pairs(cp, j, T, B * HQ, q.device):
                kb, vb = _split_kv(cur, lo, hi, D, cdt)
                s = _scores(qg[:, :, :, a:b], kb, mask, scale)
                m = s.amax(-1)
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows that see nothing here
                p = torch.exp(s - m[..., None])
                l = p.sum(-1)
                Lq, Lk = b - a, hi - lo
                ob = torch.matmul(p.view(B, HKV, G * Lq, Lk), vb).view(B, HKV, G, Lq, Dv)  # unnormalised
                # merge by log-sum-exp: o = o_old·e^(lse_old − lse) + Σ p v · e^(m − lse)
                old = lse[..., a:b]
                new = torch.logaddexp(old, m + torch.log(l))
                base = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # -inf: nothing seen yet
                w_old = torch.exp(old - base)
                w_new = torch.where(l > 0, torch.exp(m - base), torch.zeros_like(m))
                o[..., a:b, :] = o[..., a:b, :] * w_old[..., None] + ob * w_new[..., None]
                lse[..., a:b] = new
            got = transfer.wait()
            if recvs:
                cur = got[0]
        out = o.permute(0, 3, 1, 2, 4).reshape(B, T, HQ, Dv).to(v.dtype)
        ctx.cp, ctx.scale = cp, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @torch.autocast("cuda", enabled=False)
    @torch.autocast("cpu", enabled=False)
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        cp, scale = ctx.cp, ctx.scale
        B, T, HQ, D = q.shape
        HKV, Dv = k.shape[2], v.shape[3]
        G, r, cdt = HQ // HKV, cp.rank, lse.dtype
        plan = ring_plan(cp)

        def grouped(x):  # [B, T, HQ, ·] -> [B, HKV, G, T, ·] in cdt
            return x.reshape(B, T, HKV, G, x.shape[-1]).permute(0, 2, 3, 1, 4).to(cdt)

        qg, dog = grouped(q), grouped(do)
        delta = (dog * grouped(out)).sum(-1)  # Σ_v do·o per query and head
        dq = torch.zeros_like(qg)
        cur = torch.cat([k, v.to(k.dtype)], -1)
        acc = q.new_zeros((B, HKV, T, D + Dv), dtype=cdt)  # the gradient of the block in hand: [dk | dv]
        mine = None
        for i in range(plan["steps"]):
            j = r - i
            if i <= plan["recv"]:
                for a, b, lo, hi, mask in _pairs(cp, j, T, B * HQ, q.device):
                    kb, vb = _split_kv(cur, lo, hi, D, cdt)
                    qc, doc = qg[:, :, :, a:b], dog[:, :, :, a:b]
                    Lq, Lk = b - a, hi - lo
                    p = torch.exp(_scores(qc, kb, mask, scale) - lse[..., a:b, None])  # every query sees itself: lse finite
                    dp = torch.matmul(doc.reshape(B, HKV, G * Lq, Dv), vb.mT).view(B, HKV, G, Lq, Lk)
                    ds = (p * (dp - delta[..., a:b, None])).view(B, HKV, G * Lq, Lk)
                    p = p.view(B, HKV, G * Lq, Lk)
                    acc[:, :, lo:hi, D:] += torch.matmul(p.mT, doc.reshape(B, HKV, G * Lq, Dv))
                    acc[:, :, lo:hi, :D] += torch.matmul(ds.mT, qc.reshape(B, HKV, G * Lq, D)) * scale
                    dq[..., a:b, :] += torch.matmul(ds, kb).view(B, HKV, G, Lq, D) * scale
            sends, recvs = [], []
            if i < plan["send"]:  # rank r + 1 reads block j too: pass it on with its gradient so far
                sends += [(cur, r + 1, 0), (acc, r + 1, 1)]
            elif 0 < i <= plan["recv"]:  # no later rank reads block j: its gradient is complete
                sends.append((acc, j, 2))
            elif i == 0:
                mine = acc
            if i < plan["recv"]:
                Tn = cp.bounds[j] - cp.bounds[j - 1]
                recvs += [((B, Tn, HKV, D + Dv), cur.dtype, r - 1, 0), ((B, HKV, Tn, D + Dv), cdt, r - 1, 1)]
            if i == plan["last"] - r and plan["last"] > r:
                recvs.append(((B, HKV, T, D + Dv), cdt, plan["last"], 2))
            got = Transfer(sends, recvs, cp.group, q.device).wait()
            if i < plan["recv"]:
                cur, acc = got[0], got[1]
            if i == plan["last"] - r and plan["last"] > r:
                mine = got[-1]
        dq = dq.permute(0, 3, 1, 2, 4).reshape(B, T, HQ, D).to(q.dtype)
        dk = mine[..., :D].transpose(1, 2).to(k.dtype)
        dv = mine[..., D:].transpose(1, 2).to(v.dtype)
        return dq, dk, dv, None, None
