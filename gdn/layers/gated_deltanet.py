"""Gated DeltaNet layer: ``S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``."""
from __future__ import annotations

import torch

from .. import ops
from ._recurrent import MASKED_GATE_INPUT, RecurrentMixer, l2_normalise, scalar_decay
from .deltanet import check_beta_offset


def gated_delta_core(q, k, v, a, b, A_log, dt_bias, *, allow_neg_eigval=False, scale=None, initial_state=None,
                     output_final_state=False, cu_seqlens=None):
    """The Gated DeltaNet prologue and recurrence in one call (the unit a fused kernel replaces).

    L2-normalises q and k, forms ``g = −exp(A_log)·softplus(a + dt_bias)`` and ``β = sigmoid(b)``
    (``2·sigmoid(b)`` with ``allow_neg_eigval``) in fp32, and runs :func:`gdn.ops.gated_delta_rule`.

    Args:
        q, k: [B, T, H, K] (after the short convolution); v: [B, T, HV, V].
        a, b: [B, T, HV] gate and β pre-activations; A_log, dt_bias: [HV].
        initial_state: [N, HV, K, V] fp32; cu_seqlens: [N+1] (B == 1).
    Returns:
        ``(o [B, T, HV, V], final state [N, HV, K, V] fp32 or None)``.
    """
    g = scalar_decay(a, A_log, dt_bias)
    beta = torch.sigmoid(b.float())
    if allow_neg_eigval:
        beta = beta * 2.0
    return ops.gated_delta_rule(l2_normalise(q), l2_normalise(k), v, g, beta, scale=scale,
                                initial_state=initial_state, output_final_state=output_final_state,
                                cu_seqlens=cu_seqlens)


def _fused_core():
    """``gdn.ops.fused.gated_delta_rule_fused`` (the Triton-fused prologue + op), or None when absent."""
    try:
        from ..ops.fused import gated_delta_rule_fused  # noqa: PLC0415
    except ImportError:
        return None
    return gated_delta_rule_fused


def core_for(x: torch.Tensor):
    """The function running :func:`gated_delta_core`'s contract for tensors like ``x``: the fused
    entry point on CUDA when :mod:`gdn.ops.fused` exists, else :func:`gated_delta_core`."""
    fused = _fused_core() if x.is_cuda else None
    return fused if fused is not None else gated_delta_core


class GatedDeltaNet(RecurrentMixer):
    """Gated DeltaNet token mixer (Yang, Kautz & Hatamizadeh, 2025).

    q/k/v projections → short conv + SiLU → L2 norm of q, k → gated delta rule with
    ``g = −exp(A_log)·softplus(a_proj x + dt_bias)`` and ``β = sigmoid(b_proj x)`` → RMSNorm per
    head × SiLU(g_proj x) → o_proj. ``A_log`` starts at log U(0.01, 16); ``dt_bias`` at the inverse
    softplus of dt, log-uniform in [1e-3, 0.1]. Both are flagged ``_no_weight_decay``. Everything
    after the short convolutions is one call with :func:`gated_delta_core`'s contract: on CUDA the
    fused entry point :func:`gdn.ops.fused.gated_delta_rule_fused` when present (:func:`core_for`).

    Args: those of :class:`gdn.layers._recurrent.RecurrentMixer`, plus ``allow_neg_eigval``
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

    def _mix(self, q, k, v, x, mask, initial_state, output_final_state, cu_seqlens):
        a, b = self.a_proj(x), self.b_proj(x)
        if self.beta_offset:
            b = b + self.beta_offset
        if mask is not None:
            a = a.masked_fill(~mask[..., None], MASKED_GATE_INPUT)
        return core_for(q)(q, k, v, a, b, self.A_log, self.dt_bias, allow_neg_eigval=self.allow_neg_eigval,
                           initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
