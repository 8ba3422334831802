"""Gated linear attention with a Mamba2-style scalar decay: ``S_t = exp(g_t) S_{t-1} + k_t v_tᵀ``."""
from __future__ import annotations

from .. import ops
from ..distributed import recurrent as cp_ops
from ..ops.gates import l2_normalise, scalar_decay
from .recurrent import MASKED_GATE_INPUT, RecurrentMixer


class GatedLinearAttention(RecurrentMixer):
    """Gated linear attention with one decay per head and token, ``g = −exp(A_log)·softplus(a_proj x + dt_bias)``
    (Mamba2's parameterisation, initialised as in :class:`GatedDeltaNet`); q and k are L2-normalised.

    Args as :class:`gdn.layers.recurrent.RecurrentMixer`. Forward: ``x`` [B, T, D] ->
    ``(o [B, T, D], RecurrentState or None)``.
    """

    has_decay = True

    def _mix(self, q, k, v, proj, mask, initial_state, output_final_state, cu_seqlens, context_parallel=None,
             update=None):
        a = proj("a_proj")
        if mask is not None:
            a = a.masked_fill(~mask[..., None], MASKED_GATE_INPUT)
        g = scalar_decay(a, self.A_log, self.dt_bias)
        if context_parallel is not None:
            return cp_ops.gated_linear_attention(l2_normalise(q), l2_normalise(k), v, g, cp=context_parallel)
        if update is not None:
            return ops.recurrent_step_(l2_normalise(q), l2_normalise(k), v, g, None, update), None
        return ops.gated_linear_attention(l2_normalise(q), l2_normalise(k), v, g, initial_state=initial_state,
                                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)
