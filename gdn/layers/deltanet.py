"""DeltaNet layer: ``S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ`` (no decay)."""
from __future__ import annotations

import torch

from .. import ops
from ._recurrent import RecurrentMixer, l2_normalise


class DeltaNet(RecurrentMixer):
    """DeltaNet token mixer: the Gated DeltaNet skeleton without the decay gate.

    β = sigmoid(b_proj x) (``allow_neg_eigval``: 2·sigmoid). Args as
    :class:`gdn.layers._recurrent.RecurrentMixer`. Forward: ``x`` [B, T, D] ->
    ``(o [B, T, D], RecurrentState or None)``.
    """

    has_delta = True

    def __init__(self, *args, allow_neg_eigval: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.allow_neg_eigval = bool(allow_neg_eigval)

    def _mix(self, q, k, v, x, mask, initial_state, output_final_state, cu_seqlens):
        beta = torch.sigmoid(self.b_proj(x).float())
        if self.allow_neg_eigval:
            beta = beta * 2.0
        return ops.delta_rule(l2_normalise(q), l2_normalise(k), v, beta, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens)
