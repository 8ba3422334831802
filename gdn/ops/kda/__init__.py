"""The per-channel-gate family: Kimi Delta Attention,
``S_t = (I − β_t k_t k_tᵀ) diag(exp g_t) S_{t-1} + β_t k_t v_tᵀ`` with ``g_t ∈ R^K``.

Same shape as :mod:`gdn.ops.delta`: :mod:`.reference` (the spec, on delta's recurrence, which
takes a per-channel gate), :mod:`.chunk` (PyTorch, sharing delta's triangular inverse),
:mod:`.triton` (chunk kernels on the launch machinery and chunk layout of the delta kernels, and
token-recurrent kernels with a backward). :func:`run` runs a validated call on the
implementation :mod:`gdn.ops.router` picked.
"""
from __future__ import annotations

from ..router import CHUNK, HAS_TRITON, NAIVE, TRITON_CHUNK, decode_step
from . import chunk, reference

if HAS_TRITON:
    from .triton.chunk import chunk_kda
    from .triton.recurrent import recurrent_kda


def run(impl: str, q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None):
    """KDA on implementation ``impl``; shapes as in :func:`gdn.ops.kimi_delta_attention`."""
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if impl == NAIVE:
        if cu_seqlens is not None and decode_step(q.shape[1], cu_seqlens):
            o, S = reference.kimi_delta_attention(*(x.transpose(0, 1) for x in (q, k, v, g, beta)),
                                                  **dict(kw, cu_seqlens=None))
            return o.transpose(0, 1), S
        return reference.kimi_delta_attention(q, k, v, g, beta, **kw)
    if impl == CHUNK:
        return chunk.kimi_delta_attention(q, k, v, g, beta, **kw)
    return (chunk_kda if impl == TRITON_CHUNK else recurrent_kda)(q, k, v, g, beta, **kw)
