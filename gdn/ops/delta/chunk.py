"""Chunkwise-parallel PyTorch forms of the four recurrent members (any device, autograd).

Split the sequence into chunks of C tokens. Inside a chunk (positions i, j = 1..C), with
``γ_i = Σ_{l≤i} g_l`` (in-chunk cumulative log decay), ``Γ_i = exp(γ_i)`` and the chunk's start
state ``S``, the recurrence unrolls to (derivation in docs/MATH.md)::

    D_ij   = exp(γ_i − γ_j) for j ≤ i, else 0                       (decay between positions)
    A      = tril(diag(β) (K Kᵀ ⊙ D), −1)                           (delta members only)
    [U, W] = (I + A)⁻¹ [diag(β) V, diag(β Γ) K]                     (WY/UT form: one triangular inverse)
    δ      = U − W S                                               (the corrected values written)
    O      = scale · ((Q Kᵀ ⊙ D) δ + diag(Γ) Q S)
    S'     = Γ_C S + (diag(exp(γ_C − γ)) K)ᵀ δ

Members without the delta term use ``δ = V`` (no solve); ungated members ``g = 0``. Everything
that does not depend on ``S`` is computed for all chunks at once; the only sequential part is
the state pass ``S' = M S + b`` with ``M = Γ_C I − K̃ᵀ W`` (a K×K matrix per chunk) and
``b = K̃ᵀ U``, one batched matmul per chunk. Memory is O(T·C + T·K·V/C): no T×T matrix.
"""
from __future__ import annotations

import math

import torch

from .reference import compute_dtype

DEFAULT_CHUNK_SIZE = 64


def _mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Batched ``x @ y`` for [..., m, k] × [..., k, n] (same leading dims), through ``bmm``.

    When both operands are row-major the product is taken as ``(yᵀ xᵀ)ᵀ``: on the CPU, MKL's
    batched kernel for two row-major operands ran ~2× slower than for any transposed variant at
    these sizes (64×64, batch 256: 2.4 ms against 1.05 ms), and ``torch.matmul``'s folding of
    4-D operands added copies. On CUDA every variant costs the same, so nothing is lost there.
    """
    lead = x.shape[:-2]
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    y3 = y.reshape(-1, y.shape[-2], y.shape[-1])
    if x3.stride(-1) == 1 and y3.stride(-1) == 1:
        out = torch.bmm(y3.mT, x3.mT).mT
    else:
        out = torch.bmm(x3, y3)
    return out.reshape(*lead, out.shape[-2], out.shape[-1])


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)⁻¹`` for strictly lower-triangular ``A`` [..., C, C], by blockwise doubling.

    For ``L = [[L11, 0], [L21, L22]]``, ``L⁻¹ = [[L11⁻¹, 0], [−L22⁻¹ L21 L11⁻¹, L22⁻¹]]``. Starting
    from 1×1 diagonal blocks (the identity), each level joins pairs of adjacent diagonal blocks,
    all pairs at once: log2(C) levels of two batched matmuls, C³/3 multiply-adds in all (a
    triangular solve's count) but only matmuls, which stay fast where LAPACK's batched
    triangular solve is slow (on a loaded CPU it can be 100× slower). Differentiable.
    """
    *batch, C, _ = A.shape
    size = 1 << max(0, (C - 1).bit_length())
    if size != C:  # pad to a power of two: the extra rows and columns are the identity's
        A = torch.nn.functional.pad(A, (0, size - C, 0, size - C))
    T = torch.ones(*batch, size, 1, 1, dtype=A.dtype, device=A.device)  # inverses of the 1×1 blocks
    b = 1
    while b < size:
        nb = size // (2 * b)
        blocks = torch.diagonal(A.reshape(*batch, nb, 2 * b, nb, 2 * b), dim1=-4, dim2=-2)
        L21 = blocks.movedim(-1, -3)[..., b:, :b]  # [..., nb, b, b]
        T11, T22 = T[..., 0::2, :, :], T[..., 1::2, :, :]
        X21 = -_mm(T22, _mm(L21, T11))
        top = torch.cat([T11, torch.zeros_like(T11)], dim=-1)
        bottom = torch.cat([X21, T22], dim=-1)
        T = torch.cat([top, bottom], dim=-2)  # [..., nb, 2b, 2b]
        b *= 2
    T = T.reshape(*batch, size, size)
    return T[..., :C, :C] if size != C else T


def _chunk_core(q, k, v, g, beta, scale, S0, C, starts=None, ends=None, N=None):
    """Chunkwise evaluation of a stream whose length is a multiple of C.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV] or None (compute dtype).
    Without ``starts`` every batch row is one sequence starting from ``S0`` [B, HV, K, V] (or 0).
    With ``starts``/``ends`` (B == 1, packed): dicts chunk index -> sequence index; the state
    is reset to ``S0[n]`` where sequence n starts and recorded where it ends.
    Returns o [B, T, HV, V] and the final states [N, HV, K, V].

    Internally every tensor is laid out ``[NC·B·HV, C, D]`` (chunk index outermost), so the
    batched products are plain ``bmm`` calls and the state pass slices one contiguous chunk.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV != H:  # grouped value heads: value head j reads q/k head j // (HV // H)
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    NC, BH = T // C, B * HV
    dt, dev = v.dtype, v.device

    def chunks(x):  # [B, T, HV, *D] -> [NC·B·HV, C, *D]
        y = x.reshape(B, NC, C, HV, -1).permute(1, 0, 3, 2, 4).reshape(NC * BH, C, -1)
        return y if x.dim() == 4 else y.squeeze(-1)

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    kT = kc.mT

    incl = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    if g is not None:
        gamma = chunks(g).cumsum(-1)  # γ: [NB, C]
        decay = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~incl, -math.inf))
        Gam = torch.exp(gamma)  # Γ_i
        to_end = torch.exp(gamma[..., -1:] - gamma)  # exp(γ_C − γ_i)
        chunk_decay = Gam[..., -1]  # Γ_C: [NB]
    else:
        decay = incl.to(dt)
        Gam = to_end = chunk_decay = None

    Qg = qc if Gam is None else qc * Gam[..., None]  # diag(Γ) Q
    KtT = (kc if to_end is None else kc * to_end[..., None]).mT  # K̃ᵀ, K̃ = diag(exp(γ_C − γ)) K
    P = _mm(qc, kT) * decay
    if beta is not None:
        bc = chunks(beta)
        strict = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)
        A = (_mm(kc, kT) * decay * bc[..., :, None]).masked_fill(~strict, 0.0)
        Tinv = unit_lower_inverse(A)
        kb = kc * (bc if Gam is None else bc * Gam)[..., None]  # diag(β Γ) K
        U, W = _mm(Tinv, vc * bc[..., None]), _mm(Tinv, kb)  # [NB, C, V], [NB, C, K]
        Qw = Qg - _mm(P, W)  # O = scale (P U + (diag(Γ) Q − P W) S)
        b = _mm(KtT, U)
        M = -_mm(KtT, W)  # M = Γ_C I − K̃ᵀ W: add Γ_C on the diagonal in place (no K×K broadcast product)
        M.diagonal(dim1=-2, dim2=-1).add_(1.0 if chunk_decay is None else chunk_decay[..., None])
    else:
        U, Qw, M = vc, Qg, None
        b = _mm(KtT, vc)

    # Sequential state pass over chunks: S <- M S + b (M the scalar Γ_C for non-delta members).
    if S0 is None or starts is not None:
        S = torch.zeros(BH, K, V, dtype=dt, device=dev)
    else:
        S = S0.reshape(BH, K, V)
    finals = [None] * (N or 0)
    before = []
    Ms = M.view(NC, BH, K, K).unbind(0) if M is not None else None
    bs = b.reshape(NC, BH, K, V).unbind(0)
    decays = chunk_decay.view(NC, BH).unbind(0) if chunk_decay is not None else None
    for n in range(NC):
        if starts is not None and n in starts:
            i = starts[n]
            S = S0[i].reshape(BH, K, V) if S0 is not None else torch.zeros_like(S)
        before.append(S)
        if M is not None:
            S = torch.baddbmm(bs[n], Ms[n], S)
        elif chunk_decay is not None:
            S = torch.addcmul(bs[n], decays[n][:, None, None], S)
        else:
            S = S + bs[n]
        if ends is not None and n in ends:
            finals[ends[n]] = S
    states = torch.stack(before).reshape(NC * BH, K, V)  # the state entering each chunk
    o = (_mm(P, U) + _mm(Qw, states)) * scale  # scale (P U + Qw S)
    o = o.reshape(NC, B, HV, C, V).permute(1, 0, 3, 2, 4).reshape(B, T, HV, V)
    final = S.reshape(B, HV, K, V) if starts is None else finals
    return o, final


def run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size=DEFAULT_CHUNK_SIZE):
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt, out_dtype = compute_dtype(v), v.dtype
    scale = K ** -0.5 if scale is None else scale
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    g = None if g is None else g.to(dt)
    beta = None if beta is None else beta.to(dt)
    S0 = None if initial_state is None else initial_state.to(dt)

    if cu_seqlens is None:
        C = min(chunk_size, T)
        pad = (-T) % C
        if pad:
            # Zero tokens at the end (k = v = 0, g = 0, beta = 0) leave the state unchanged.
            q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
            g = None if g is None else torch.nn.functional.pad(g, (0, 0, 0, pad))
            beta = None if beta is None else torch.nn.functional.pad(beta, (0, 0, 0, pad))
        o, final = _chunk_core(q, k, v, g, beta, scale, S0, C)
        o = o[:, :T]
    else:
        o, final = _run_packed(q, k, v, g, beta, scale, S0, cu_seqlens, chunk_size)
    return o.to(out_dtype), (final if output_final_state else None)


def _run_packed(q, k, v, g, beta, scale, S0, cu_seqlens, chunk_size):
    """Packed sequences: lay each sequence out from a chunk boundary (zero-padded to a multiple
    of C) in one stream, so no chunk straddles two sequences, and reset the state at each start."""
    bounds = cu_seqlens.tolist()
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    N = len(lens)
    C = max(1, min(chunk_size, max(lens)))
    padded = [-(-L // C) * C for L in lens]
    dev = q.device
    src = torch.full((sum(padded),), -1, dtype=torch.long, device=dev)
    starts, ends, empty = {}, {}, []
    pos = 0
    for n, (s, L, Lp) in enumerate(zip(bounds[:-1], lens, padded)):
        if L == 0:
            empty.append(n)
            continue
        src[pos : pos + L] = torch.arange(s, s + L, device=dev)
        starts[pos // C] = n
        ends[(pos + Lp) // C - 1] = n
        pos += Lp
    valid = src >= 0
    idx = src.clamp(min=0)

    def gather(x):
        if x is None:
            return None
        y = x[0].index_select(0, idx)
        return (y * valid.view(-1, *([1] * (y.dim() - 1))).to(y.dtype)).unsqueeze(0)

    o_s, finals = _chunk_core(
        gather(q), gather(k), gather(v), gather(g), gather(beta), scale, S0, C, starts=starts, ends=ends, N=N
    )
    o = o_s[0][valid].unsqueeze(0)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    for n in empty:
        finals[n] = S0[n : n + 1].view(1, -1, K, V) if S0 is not None else v.new_zeros(1, HV, K, V)
    final = torch.cat([f.reshape(1, HV, K, V) for f in finals], dim=0)
    return o, final


def linear_attention(q, k, v, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     chunk_size=DEFAULT_CHUNK_SIZE):
    """Chunkwise ``S += k vᵀ``, ``o = scale Sᵀ q``. Shapes as in :func:`gated_delta_rule`."""
    return run(q, k, v, None, None, scale, initial_state, output_final_state, cu_seqlens, chunk_size)


def gated_linear_attention(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, chunk_size=DEFAULT_CHUNK_SIZE):
    """Chunkwise Mamba2-style ``S = exp(g) S + k vᵀ``. ``g``: [B, T, HV]."""
    return run(q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens, chunk_size)


def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
               chunk_size=DEFAULT_CHUNK_SIZE):
    """Chunkwise DeltaNet ``S = (I − β k kᵀ) S + β k vᵀ``. ``beta``: [B, T, HV]."""
    return run(q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, chunk_size=DEFAULT_CHUNK_SIZE):
    """Chunkwise Gated DeltaNet ``S = exp(g) (I − β k kᵀ) S + β k vᵀ``, ``o = scale Sᵀ q``.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; initial_state: [N, HV, K, V];
    cu_seqlens: [N + 1] (B == 1). Returns ``(o in v.dtype, final state or None)``.
    """
    return run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
