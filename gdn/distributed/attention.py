"""Causal softmax attention over a sequence split along T across ranks.

Sliding window W: a query sees at most the W − 1 keys before it, so a rank needs the last W − 1
keys and values of the ranks before it: one halo exchange (:func:`gdn.distributed.halo`, from the
previous rank when every slice holds at least W − 1 tokens). Memory and compute per rank stay
O(T_r · W). Global attention: an all-gather of every rank's keys and values (each rank keeps those
of the ranks up to it), O(T) keys per rank; a ring exchange would keep that at O(T_r) and is not
implemented. The gradients of the keys and values return to their ranks in the backward.

Queries go in blocks of :data:`QUERY_BLOCK` against only the keys they can see, with an explicit
mask (causal, window, same packed sequence) through ``scaled_dot_product_attention``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .comm import all_gather, halo

__all__ = ["softmax_attention", "QUERY_BLOCK"]

#: Queries per block of the masked attention.
QUERY_BLOCK = 1024


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
