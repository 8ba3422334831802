"""Softmax attention: through ``torch.nn.functional.scaled_dot_product_attention``, and the
explicit masked-scores form (:func:`softmax_attention_naive`, the spec).

Causal or not, sliding window, packed sequences (``cu_seqlens``) and grouped query heads.
A sliding window is evaluated in query blocks against only the keys they can see, so memory is
O(T·window), never a T×T mask; packed sequences run one by one so no mask spans two of them.

Under ``torch.compile`` dynamo traces the unpacked path (SDPA and indexing). A packed call loops
over sequences whose bounds are read on the host, so it is the custom op ``gdn::softmax_attention``
(:mod:`gdn.ops.library`), whose backward recomputes it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import library, offsets
from .delta.reference import compute_dtype


def _sdpa(q, k, v, scale, causal, mask=None):
    """q: [B, HQ, Tq, K]; k, v: [B, HKV, Tk, D]."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          scale=scale, enable_gqa=gqa)


def _dense(q, k, v, scale, causal, window_size):
    """One batch of whole sequences, layout [B, T, heads, D] in and out."""
    T = q.shape[1]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if window_size is None or window_size >= T:
        o = _sdpa(q, k, v, scale, causal)
    else:
        W = window_size
        block = max(W, 128)
        outs = []
        for s in range(0, T, block):
            e = min(T, s + block)
            ks = max(0, s - W + 1)
            tq = torch.arange(s, e, device=q.device)[:, None]
            tk = torch.arange(ks, e, device=q.device)[None, :]
            mask = (tk <= tq) & (tq - tk < W)
            outs.append(_sdpa(q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e], scale, causal, mask))
        o = torch.cat(outs, dim=2)
    return o.transpose(1, 2)


def softmax_attention(q, k, v, *, scale=None, causal=True, window_size=None, cu_seqlens=None):
    """Softmax attention. q: [B, T, HQ, K]; k: [B, T, HKV, K]; v: [B, T, HKV, V] (HQ a multiple
    of HKV); ``window_size`` W lets query t see keys t−W+1..t; ``cu_seqlens`` [N+1] packs
    sequences along T (B == 1). Returns o: [B, T, HQ, V] in v.dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        return _dense(q, k, v, scale, causal, window_size)
    bounds = offsets.host(cu_seqlens).tolist()  # one host copy per offsets tensor, not per layer
    outs = [
        _dense(q[:, s:e], k[:, s:e], v[:, s:e], scale, causal, window_size)
        for s, e in zip(bounds[:-1], bounds[1:])
        if e > s
    ]
    return torch.cat(outs, dim=1)


def attention_mask(T: int, *, causal: bool = True, window_size=None, cu_seqlens=None, device=None) -> torch.Tensor:
    """Boolean ``[T, T]`` mask, True where query t may attend to key s: ``s <= t`` (causal),
    ``t - s < window_size`` (sliding window: the window counts the query itself), and both in
    the same packed sequence."""
    t = torch.arange(T, device=device)
    allowed = torch.ones(T, T, dtype=torch.bool, device=device)
    if causal:
        allowed &= t[None, :] <= t[:, None]
    if window_size is not None:
        allowed &= (t[:, None] - t[None, :]) < window_size
    if cu_seqlens is not None:
        seq = torch.bucketize(t, cu_seqlens.to(device=device, dtype=torch.long)[1:], right=True)
        allowed &= seq[:, None] == seq[None, :]
    return allowed


def softmax_attention_naive(q, k, v, *, scale=None, causal=True, window_size=None, cu_seqlens=None):
    """Masked softmax attention with an explicit ``[T, T]`` score matrix (the spec, not fast).

    q: [B, T, HQ, K]; k: [B, T, HKV, K]; v: [B, T, HKV, V]; HQ a multiple of HKV (query head j
    reads key/value head ``j // (HQ // HKV)``). Returns o: [B, T, HQ, V] in v.dtype.
    """
    B, T, HQ, K = q.shape
    HKV = k.shape[2]
    dt = compute_dtype(v)
    scale = K ** -0.5 if scale is None else scale
    group = HQ // HKV
    kk = k.to(dt).repeat_interleave(group, dim=2)
    vv = v.to(dt).repeat_interleave(group, dim=2)
    scores = torch.einsum("bthk,bshk->bhts", q.to(dt), kk) * scale
    mask = attention_mask(T, causal=causal, window_size=window_size, cu_seqlens=cu_seqlens, device=q.device)
    scores = scores.masked_fill(~mask, -math.inf)
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bhts,bshv->bthv", p, vv).to(v.dtype)


# ---- the custom op of packed calls (torch.compile) ----------------------------------------------

def _packed_run(q, k, v, scale, causal, window_size, cu_seqlens, naive, autocast):
    fn = softmax_attention_naive if naive else softmax_attention
    with library.autocast_as(q.device.type, autocast):
        return (fn(q, k, v, scale=scale, causal=causal, window_size=window_size, cu_seqlens=cu_seqlens).contiguous(),)


def _packed_fake(q, k, v, scale, causal, window_size, cu_seqlens, naive, autocast):
    # SDPA returns q's dtype, or the autocast dtype (it is on autocast's lower-precision list); the spec v's
    dtype = v.dtype if naive else (autocast or q.dtype)
    return (q.new_empty((*q.shape[:3], v.shape[3]), dtype=dtype),)


packed_op = library.recomputed_op(
    "softmax_attention",
    "Tensor q, Tensor k, Tensor v, float? scale, bool causal, int? window_size, Tensor cu_seqlens, bool naive, "
    "ScalarType? autocast",
    1, _packed_run, _packed_fake, differentiable=(0, 1, 2), tags=library.HOST_READS)
