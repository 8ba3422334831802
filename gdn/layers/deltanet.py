"""DeltaNet layer: ``S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ`` (no decay)."""
from __future__ import annotations

import math

from .. import ops
from ..distributed import recurrent as cp_ops
from ..ops.gates import l2_normalise, write_strength
from .recurrent import RecurrentMixer


def check_beta_offset(beta_offset) -> float:
    """``beta_offset`` as a float, or ValueError. It is a constant added to the β pre-activation
    ``b_proj x`` (no parameter, so checkpoints are unchanged): with ``b_proj`` near zero at
    initialisation, β starts near ``sigmoid(beta_offset)`` instead of 0.5 and stays learnable through
    ``b_proj``. 0 (the default) is the published DeltaNet / Gated DeltaNet (and Qwen3-Next's) β."""
    if isinstance(beta_offset, bool) or not isinstance(beta_offset, (int, float)) or not math.isfinite(beta_offset):
        raise ValueError(f"beta_offset must be a finite number, got {beta_offset!r}")
    return float(beta_offset)


class DeltaNet(RecurrentMixer):
    """DeltaNet token mixer: the Gated DeltaNet skeleton without the decay gate.

    β = sigmoid(b_proj x + beta_offset) (``allow_neg_eigval``: 2·sigmoid). Args as
    :class:`gdn.layers.recurrent.RecurrentMixer`, plus ``beta_offset`` (see
    :func:`check_beta_offset`; default 0, the published layer). Forward: ``x`` [B, T, D] ->
    ``(o [B, T, D], RecurrentState or None)``.
    """

    has_delta = True

    def __init__(self, *args, allow_neg_eigval: bool = False, beta_offset: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.allow_neg_eigval = bool(allow_neg_eigval)
        self.beta_offset = check_beta_offset(beta_offset)

    def _mix(self, q, k, v, proj, mask, initial_state, output_final_state, cu_seqlens, context_parallel=None,
             update=None):
        b = proj("b_proj").float()
        beta = write_strength(b + self.beta_offset if self.beta_offset else b, self.allow_neg_eigval)
        if context_parallel is not None:
            return cp_ops.delta_rule(l2_normalise(q), l2_normalise(k), v, beta, cp=context_parallel)
        if update is not None:
            return ops.recurrent_step_(l2_normalise(q), l2_normalise(k), v, None, beta, update), None
        return ops.delta_rule(l2_normalise(q), l2_normalise(k), v, beta, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens)
