"""Kimi Delta Attention (KDA): the gated delta rule with a per-channel gate, token by token (the spec).

Per value head, with state ``S`` of shape ``[K, V]`` and a gate ``g_t ∈ R^K`` (log decays, ≤ 0)::

    S = diag(exp(g_t)) S                             (every key channel forgets at its own rate)
    S = S + beta_t k_t (v_t − Sᵀ k_t)ᵀ               (delta rule on the decayed state)
    o_t = scale · Sᵀ q_t

With ``g_t`` equal across the K channels this is exactly :func:`gdn.ops.delta.reference.gated_delta_rule`.
Everything is computed in ``promote(dtype, float32)``; the output comes back in ``v.dtype``.
:func:`check_kda` validates a call (the public op validates before any backend runs).
"""
from __future__ import annotations


from ..checks import check_recurrent, float_tensor, shape_str
from ..delta.reference import run


def check_kda(q, k, v, g, beta, initial_state, cu_seqlens, scale, backend=None):
    """Validate a KDA call: the gated-delta contract with ``g`` of shape [B, T, HV, K].

    Raises ``ValueError``/``TypeError`` naming the argument; returns the call's
    :class:`gdn.ops.checks.Dims`."""
    dims = check_recurrent(q, k, v, None, beta, initial_state, cu_seqlens, scale, backend)
    if beta is None:
        raise ValueError("beta must be a [B, T, HV] tensor for kimi_delta_attention, got None")
    float_tensor("g", g)
    if tuple(g.shape) != (dims.B, dims.T, dims.HV, dims.K):
        raise ValueError(f"g must have shape [B, T, HV, K] = [{dims.B}, {dims.T}, {dims.HV}, {dims.K}], got {shape_str(g)}")
    if g.device != q.device:
        raise ValueError(f"g is on {g.device} but q is on {q.device}; all inputs must share a device")
    return dims


def kimi_delta_attention(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None):
    """KDA recurrence: ``S = diag(exp g_t) S; S += β_t k_t (v_t − Sᵀk_t)ᵀ; o_t = scale · Sᵀ q_t``.

    Args:
        q, k: [B, T, H, K] (keys L2-normalised); v: [B, T, HV, V], HV a multiple of H.
        g: [B, T, HV, K] per-channel log decay (≤ 0); beta: [B, T, HV].
        scale: default ``K ** -0.5``. initial_state: [N, HV, K, V]. cu_seqlens: [N + 1] (B == 1).

    Returns:
        ``(o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] (compute dtype) or None)``.
    """
    return run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
