"""Gated DeltaNet layer: ``S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``."""
from __future__ import annotations

from .. import ops
from ..distributed import recurrent as cp_ops
from .recurrent import MASKED_GATE_INPUT, RecurrentMixer
from .deltanet import check_beta_offset


class GatedDeltaNet(RecurrentMixer):
    """Gated DeltaNet token mixer (Yang, Kautz & Hatamizadeh, 2025).

    q/k/v projections → short conv + SiLU → L2 norm of q, k → gated delta rule with
    ``g = −exp(A_log)·softplus(a_proj x + dt_bias)`` and ``β = sigmoid(b_proj x)`` → RMSNorm per
    head × SiLU(g_proj x) → o_proj. ``A_log`` starts at log U(0.01, 16); ``dt_bias`` at the inverse
    softplus of dt, log-uniform in [1e-3, 0.1]. Both are flagged ``_no_weight_decay``. Everything
    after the short convolutions is one call of :func:`gdn.ops.gated_delta_rule_fused` (L2 norm,
    gate, β and the recurrence; Triton kernels on CUDA).

    Args: those of :class:`gdn.layers.recurrent.RecurrentMixer`, plus ``allow_neg_eigval``
    (β = 2·sigmoid, so the transition can have negative eigenvalues) and ``beta_offset`` (a constant
    added to ``b_proj x``, see :func:`gdn.layers.deltanet.check_beta_offset`; default 0).

    Forward: ``x`` [B, T, D] -> ``(o [B, T, D], RecurrentState or None)``; see the base class.
    """

    has_decay = True
    has_delta = True

    def __init__(self, *args, allow_neg_eigval: bool = False, beta_offset: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.allow_neg_eigval = bool(allow_neg_eigval)
        self.beta_offset = check_beta_offset(beta_offset)

    def _mix(self, q, k, v, proj, mask, initial_state, output_final_state, cu_seqlens, context_parallel=None,
             update=None):
        a, b = proj("a_proj"), proj("b_proj")
        if self.beta_offset:
            b = b + self.beta_offset
        if mask is not None:
            a = a.masked_fill(~mask[..., None], MASKED_GATE_INPUT)
        if context_parallel is not None:
            return cp_ops.gated_delta_rule_fused(q, k, v, a, b, self.A_log, self.dt_bias, cp=context_parallel,
                                                 allow_neg_eigval=self.allow_neg_eigval)
        if update is not None:
            return ops.gated_delta_rule_fused_step_(q, k, v, a, b, self.A_log, self.dt_bias, update,
                                                    allow_neg_eigval=self.allow_neg_eigval), None
        return ops.gated_delta_rule_fused(q, k, v, a, b, self.A_log, self.dt_bias, allow_neg_eigval=self.allow_neg_eigval,
                                          initial_state=initial_state, output_final_state=output_final_state,
                                          cu_seqlens=cu_seqlens)
