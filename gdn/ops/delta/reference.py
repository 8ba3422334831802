"""The recurrences, token by token: the specification every other backend is tested against.

Per value head, with state ``S`` of shape ``[K, V]`` and for t = 1..T (docs/DESIGN.md, the math)::

    S = exp(g_t) * S                                  (gated members)
    S = S + beta_t * k_t (v_t - S^T k_t)^T            (delta members; else S = S + k_t v_t^T)
    o_t = scale * S^T q_t

Everything is computed in ``promote(dtype, float32)``: float32 for half inputs, float64 for
float64 inputs, so the reference can be run at high precision. Outputs come back in ``v.dtype``;
the final state in that compute dtype. The arguments are validated by :mod:`gdn.ops`; these
functions assume a valid call.
"""
from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _recurrence(q, k, v, g, beta, scale, S):
    """One batch of sequences. q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] (or [B, T, HV, K],
    a per-channel gate) or None; beta: [B, T, HV] or None; S: [B, HV, K, V] or None. Returns o [B, T, HV, V] (compute dtype) and the final S."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = compute_dtype(v)
    group = HV // H
    q = q.to(dt).repeat_interleave(group, dim=2)
    k = k.to(dt).repeat_interleave(group, dim=2)
    v = v.to(dt)
    S = torch.zeros(B, HV, K, V, dtype=dt, device=v.device) if S is None else S.to(dt)
    out = []
    for t in range(T):
        kt, vt = k[:, t], v[:, t]
        if g is not None:  # scalar gate [B, HV] or per-channel gate [B, HV, K] (KDA): decay S along K
            a = torch.exp(g[:, t].to(dt))
            S = S * a.reshape(*a.shape, *([1] * (S.dim() - a.dim())))
        if beta is not None:
            err = vt - torch.einsum("bhkv,bhk->bhv", S, kt)
            S = S + (beta[:, t].to(dt)[..., None, None] * kt[..., :, None]) * err[..., None, :]
        else:
            S = S + kt[..., :, None] * vt[..., None, :]
        out.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(out, dim=1) if out else v.new_zeros(B, 0, HV, V)
    return o, S


def run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """Run the recurrence on the call, sequence by sequence when packed."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cu_seqlens is None:
        o, S = _recurrence(q, k, v, g, beta, scale, initial_state)
    else:
        bounds = cu_seqlens.tolist()
        outs, states = [], []
        for n in range(len(bounds) - 1):
            s, e = bounds[n], bounds[n + 1]
            S0 = None if initial_state is None else initial_state[n : n + 1]
            o_n, S_n = _recurrence(
                q[:, s:e], k[:, s:e], v[:, s:e],
                None if g is None else g[:, s:e],
                None if beta is None else beta[:, s:e],
                scale, S0,
            )
            outs.append(o_n)
            states.append(S_n)
        o, S = torch.cat(outs, dim=1), torch.cat(states, dim=0)
    return o.to(v.dtype), (S if output_final_state else None)


def linear_attention(q, k, v, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """``S += k v^T``; ``o = scale S^T q``. Shapes as in :func:`gated_delta_rule`."""
    return run(q, k, v, None, None, scale, initial_state, output_final_state, cu_seqlens)


def gated_linear_attention(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Mamba2-style scalar decay: ``S = exp(g) S + k v^T``. ``g``: [B, T, HV], log of the decay."""
    return run(q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens)


def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """DeltaNet: ``S = (I - beta k k^T) S + beta k v^T``. ``beta``: [B, T, HV]."""
    return run(q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Gated DeltaNet: ``S = exp(g) (I - beta k k^T) S + beta k v^T``, ``o = scale S^T q``.

    q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H); g, beta: [B, T, HV];
    initial_state: [N, HV, K, V]; cu_seqlens: [N + 1] offsets (B == 1). Returns
    ``(o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] or None)``.
    """
    return run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
