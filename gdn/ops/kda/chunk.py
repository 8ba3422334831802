"""Kimi Delta Attention, chunkwise-parallel in PyTorch (any device, autograd).

Inside a chunk of C tokens, with ``γ_i = Σ_{l≤i} g_l ∈ R^K`` (per-channel cumulative log decay,
non-increasing because g ≤ 0) and the chunk's start state ``S``, the recurrence unrolls to::

    A_ij = β_i Σ_c k_ic k_jc exp(γ_ic − γ_jc)   for j < i      (strictly lower)
    P_ij =     Σ_c q_ic k_jc exp(γ_ic − γ_jc)   for j ≤ i      (lower, diagonal included)
    [U, W] = (I + A)⁻¹ [diag(β) V, diag(β) (K ⊙ exp γ)]
    δ  = U − W S
    O  = scale · (P δ + (Q ⊙ exp γ) S)
    S' = diag(exp γ_C) S + (K ⊙ exp(γ_C − γ))ᵀ δ

Numerics: ``exp(γ_i − γ_j)`` for ``i ≥ j`` is ≤ 1, but factoring it as ``exp(γ_i)·exp(−γ_j)``
overflows once a chunk's total decay passes ~88 nats. So the chunk is cut into sub-chunks of
``S_C`` tokens: pairs inside a diagonal sub-block use the explicit pairwise exponent (a
``[S_C, S_C, K]`` tensor, masked to ``j ≤ i`` before the exp); pairs with ``j`` in an earlier
sub-block b and ``i`` after it factor through the last position ``e_b`` of b,
``exp(γ_i − γ_{e_b}) · exp(γ_{e_b} − γ_j)``, both factors ≤ 1. Every exponent is ≤ 0.
"""
from __future__ import annotations

import math

import torch

from ..delta.chunk import unit_lower_inverse
from ..delta.reference import compute_dtype

DEFAULT_CHUNK_SIZE = 64
SUB_CHUNK = 16


def _pair_decay_products(a, b, gamma, sub):
    """``R_ij = Σ_c a_ic b_jc exp(γ_ic − γ_jc)`` for j ≤ i (else 0), stably.

    a, b, gamma: [..., C, K] -> R: [..., C, C]."""
    C = a.shape[-2]
    R = a.new_zeros(*a.shape[:-1], C)
    for s in range(0, C, sub):
        e = min(s + sub, C)
        # Diagonal block: the pairwise exponent, masked to j ≤ i before the exp.
        diff = gamma[..., s:e, None, :] - gamma[..., None, s:e, :]  # [..., c, c, K]
        keep = torch.ones(e - s, e - s, dtype=torch.bool, device=a.device).tril()
        dec = torch.exp(diff.masked_fill(~keep[..., None], -math.inf))
        R[..., s:e, s:e] = torch.einsum("...ik,...jk,...ijk->...ij", a[..., s:e, :], b[..., s:e, :], dec)
        if e < C:
            # Rows after this block read its columns through the reference point e − 1.
            ref = gamma[..., e - 1 : e, :]
            a_t = a[..., e:, :] * torch.exp(gamma[..., e:, :] - ref)
            b_t = b[..., s:e, :] * torch.exp(ref - gamma[..., s:e, :])
            R[..., e:, s:e] = a_t @ b_t.transpose(-1, -2)
    return R


def _chunks(x, B, NC, C, HV):
    """[B, NC·C, HV, *D] -> [B, HV, NC, C, *D]."""
    y = x.reshape(B, NC, C, HV, -1).permute(0, 3, 1, 2, 4)
    return y if x.dim() == 4 else y.squeeze(-1)


def _dense(q, k, v, g, beta, scale, S0, C, sub):
    """One batch of sequences whose length is a multiple of C (compute dtype throughout).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV]; S0: [B, HV, K, V] or None.
    Returns o [B, T, HV, V] and the final state [B, HV, K, V]."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV != H:
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    NC = T // C
    qc, kc, vc, gc, bc = (_chunks(x, B, NC, C, HV) for x in (q, k, v, g, beta))
    gamma = gc.cumsum(-2)  # [B, HV, NC, C, K]
    P = _pair_decay_products(qc, kc, gamma, sub)
    A = (_pair_decay_products(kc, kc, gamma, sub) * bc[..., :, None]).tril(-1)
    Tinv = unit_lower_inverse(A)
    U = Tinv @ (vc * bc[..., None])
    W = Tinv @ (kc * torch.exp(gamma) * bc[..., None])
    Qg = qc * torch.exp(gamma)
    g_end = gamma[..., -1, :]  # [B, HV, NC, K]
    Kt = kc * torch.exp(g_end[..., None, :] - gamma)  # K ⊙ exp(γ_C − γ)
    S = torch.zeros(B, HV, K, V, dtype=v.dtype, device=v.device) if S0 is None else S0
    outs = []
    for n in range(NC):
        delta = U[:, :, n] - W[:, :, n] @ S
        outs.append(scale * (P[:, :, n] @ delta + Qg[:, :, n] @ S))
        S = torch.exp(g_end[:, :, n])[..., None] * S + Kt[:, :, n].transpose(-1, -2) @ delta
    o = torch.stack(outs, dim=2)  # [B, HV, NC, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, T, HV, V), S


def _padded(q, k, v, g, beta, scale, S0, chunk_size, sub):
    """Pad T up to a multiple of the chunk (zero tokens with g = 0, β = 0 leave the state alone)."""
    T = q.shape[1]
    C = min(chunk_size, T)
    pad = (-T) % C
    if pad:
        def p(x):
            return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        q, k, v, g, beta = (p(x) for x in (q, k, v, g, beta))
    o, S = _dense(q, k, v, g, beta, scale, S0, C, min(sub, C))
    return o[:, :T], S


def kimi_delta_attention(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None, chunk_size=DEFAULT_CHUNK_SIZE, sub_chunk=SUB_CHUNK):
    """Chunkwise KDA (see the module docstring); same numbers as :func:`gdn.ops.kda.reference.kimi_delta_attention`.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] (≤ 0); beta: [B, T, HV].
        scale: default ``K ** -0.5``; initial_state: [N, HV, K, V]; cu_seqlens: [N + 1] (B == 1).
        chunk_size: tokens per chunk C; sub_chunk: tokens per sub-block of the stable decay products.

    Returns:
        ``(o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] or None)``.
    """
    for name, val in (("chunk_size", chunk_size), ("sub_chunk", sub_chunk)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    dt, out_dtype = compute_dtype(v), v.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    S0 = None if initial_state is None else initial_state.to(dt)
    if cu_seqlens is None:
        o, S = _padded(q, k, v, g, beta, scale, S0, chunk_size, sub_chunk)
    else:
        bounds = cu_seqlens.tolist()
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        outs, states = [], []
        for n in range(len(bounds) - 1):
            s, e = bounds[n], bounds[n + 1]
            S0_n = None if S0 is None else S0[n : n + 1]
            if e == s:
                states.append(S0_n if S0_n is not None else v.new_zeros(1, HV, K, V))
                continue
            o_n, S_n = _padded(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale, S0_n,
                               chunk_size, sub_chunk)
            outs.append(o_n)
            states.append(S_n)
        o, S = torch.cat(outs, dim=1), torch.cat(states, dim=0)
    return o.to(out_dtype), (S if output_final_state else None)
