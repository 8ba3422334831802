"""The scalar-gate family: linear attention, gated linear attention, DeltaNet, Gated DeltaNet.

One recurrence with optional parts, ``g`` (the decay) and ``beta`` (the delta term) None where a
member lacks them::

    S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,    o_t = scale · S_tᵀ q_t

- :mod:`.reference`: the recurrence token by token, the spec;
- :mod:`.chunk`: the chunkwise-parallel (WY/UT) form in PyTorch, any device, autograd;
- :mod:`.fused`: Gated DeltaNet from the layer's raw inputs (L2 norm, gate and β inside);
- :mod:`.triton`: the GPU kernels (chunk, token-recurrent, state pool, fused prologue).

:func:`run` runs a validated call on the implementation :mod:`gdn.ops.router` picked.
"""
from __future__ import annotations

from ..router import CHUNK, HAS_TRITON, NAIVE, TRITON_CHUNK, decode_step
from . import chunk, reference

if HAS_TRITON:
    from . import triton as kernels


def run(impl: str, q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None):
    """One member (``g`` / ``beta`` None for what it lacks) on implementation ``impl``.

    Shapes as in :func:`gdn.ops.gated_delta_rule`; returns ``(o, final state or None)``."""
    if impl == NAIVE:
        if cu_seqlens is not None and decode_step(q.shape[1], cu_seqlens):
            # a decode step of N packed one-token sequences is a batch of N: no per-sequence loop
            def as_batch(x):
                return None if x is None else x.transpose(0, 1)

            o, S = reference.run(as_batch(q), as_batch(k), as_batch(v), as_batch(g), as_batch(beta), scale,
                                 initial_state, output_final_state, None)
            return o.transpose(0, 1), S
        return reference.run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    if impl == CHUNK:
        return chunk.run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    # the kernels' entry points themselves, not run_chunk / run_recurrent: a call under torch.compile
    # reaches this only through gdn.ops.library's custom ops (never traced), and the wrappers that
    # keep dynamo out cost each eager call host time
    fn = kernels.chunk_op if impl == TRITON_CHUNK else kernels.fused_recurrent_gated_delta_rule
    return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens)
