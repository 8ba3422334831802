"""Linear attention layer: ``S_t = S_{t-1} + k_t v_tᵀ`` (no decay, no delta term)."""
from __future__ import annotations

from .. import ops
from ..distributed import recurrent as cp_ops
from ..ops.gates import l2_normalise
from .recurrent import RecurrentMixer


class LinearAttention(RecurrentMixer):
    """Linear attention token mixer with L2-normalised q and k (the per-head output RMSNorm keeps
    the growing state's read-out in scale).

    Args as :class:`gdn.layers.recurrent.RecurrentMixer`. Forward: ``x`` [B, T, D] ->
    ``(o [B, T, D], RecurrentState or None)``.
    """

    def _mix(self, q, k, v, proj, mask, initial_state, output_final_state, cu_seqlens, context_parallel=None,
             update=None):
        if context_parallel is not None:
            return cp_ops.linear_attention(l2_normalise(q), l2_normalise(k), v, cp=context_parallel)
        if update is not None:
            return ops.recurrent_step_(l2_normalise(q), l2_normalise(k), v, None, None, update), None
        return ops.linear_attention(l2_normalise(q), l2_normalise(k), v, initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens)
