"""Kimi Delta Attention layer: Gated DeltaNet with a per-channel forget gate (Kimi Linear).

    x ─ q/k/v_proj ─ conv+SiLU ─ L2 norm (q, k) ─┐
    x ─ f_a_proj ─ f_b_proj (low rank) ─ g = −exp(A_log)·softplus(· + dt_bias)   [B, T, HV, K]
    x ─ b_proj ─ sigmoid ─ β ─────────────────────┼─ KDA recurrence ─ RMSNorm per head × sigmoid(g_b(g_a x)) ─ o_proj

The skeleton (projections, short convolutions, padding and packing rules, decoding state) is
:class:`gdn.layers.recurrent.RecurrentMixer`'s; the decay is per key channel and the output gate
a low-rank sigmoid gate. The layer-pattern letter is ``K``.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..distributed import recurrent as cp_ops
from ..ops.gates import kda_gate, l2_normalise, write_strength
from .recurrent import RecurrentMixer, mamba_gate_init, positive_int
from .norm import RMSNorm


class KimiDeltaAttention(RecurrentMixer):
    """Kimi Delta Attention token mixer (Kimi Linear, 2025): the delta rule with a per-channel decay.

    Args: those of :class:`gdn.layers.recurrent.RecurrentMixer` (``use_gate`` is replaced by the
    low-rank sigmoid output gate, always on), plus ``gate_low_rank_dim`` (rank of the forget- and
    output-gate projections; default ``head_dim``).

    Parameters: ``f_a_proj`` [D → r], ``f_b_proj`` [r → HV·K] (forget gate), ``A_log`` [HV] (log U(1, 16)),
    ``dt_bias`` [HV·K] (inverse softplus of dt, log-uniform in [1e-3, 0.1]), ``b_proj`` (β),
    ``g_a_proj`` [D → r], ``g_b_proj`` [r → HV·V] (output gate), ``o_norm`` (RMSNorm per head).

    Forward: ``x`` [B, T, D] -> ``(o [B, T, D], RecurrentState or None)``; see the base class. Padded
    tokens get ``g = 0`` (and k = v = 0), so they leave the state unchanged.
    """

    has_decay = False  # the base's scalar gate; KDA brings its own per-channel one
    has_delta = True

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, num_v_heads: int | None = None,
                 expand_v: float = 1.0, use_short_conv: bool = True, conv_size: int = 4, norm_eps: float = 1e-6,
                 layer_idx: int | None = None, gate_low_rank_dim: int | None = None):
        super().__init__(hidden_size, num_heads, head_dim, num_v_heads=num_v_heads, expand_v=expand_v,
                         use_short_conv=use_short_conv, conv_size=conv_size, use_gate=False, norm_eps=norm_eps,
                         layer_idx=layer_idx)
        r = head_dim if gate_low_rank_dim is None else positive_int("gate_low_rank_dim", gate_low_rank_dim)
        self.gate_low_rank_dim = r
        D, HV, K = hidden_size, self.num_v_heads, head_dim
        self.f_a_proj = nn.Linear(D, r, bias=False)
        self.f_b_proj = nn.Linear(r, HV * K, bias=False)
        self.g_a_proj = nn.Linear(D, r, bias=False)
        self.g_b_proj = nn.Linear(r, self.value_dim, bias=False)
        init = self.gate_init_values()
        self.A_log = nn.Parameter(init["A_log"])
        self.dt_bias = nn.Parameter(init["dt_bias"])
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        # The base class applies ``o_norm`` after ``_mix``; the norm and its gate happen inside ``_mix``.
        self.out_norm = RMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_norm = nn.Identity()

    def input_projections(self) -> tuple[str, ...]:
        """q, k, v, β and the first (low-rank) halves of the forget and output gates."""
        return super().input_projections() + ("f_a_proj", "g_a_proj")

    def gate_init_values(self) -> dict[str, torch.Tensor]:
        """Fresh ``A_log`` [HV] (log U(1, 16)) and ``dt_bias`` [HV·K]."""
        A_log, _ = mamba_gate_init(self.num_v_heads, a_min=1.0, a_max=16.0)
        _, dt_bias = mamba_gate_init(self.num_v_heads * self.head_dim)
        return {"A_log": A_log, "dt_bias": dt_bias}

    def _mix(self, q, k, v, proj, mask, initial_state, output_final_state, cu_seqlens, context_parallel=None,
             update=None):
        B, T = q.shape[:2]
        HV, K, V = self.num_v_heads, self.head_dim, self.head_v_dim
        g = kda_gate(self.f_b_proj(proj("f_a_proj")).view(B, T, HV, K), self.A_log, self.dt_bias)
        if mask is not None:
            g = g.masked_fill(~mask[..., None, None], 0.0)
        beta = write_strength(proj("b_proj")).to(g.dtype)
        if context_parallel is not None:
            o, S = cp_ops.kimi_delta_attention(l2_normalise(q), l2_normalise(k), v, g, beta, cp=context_parallel)
        elif update is not None:  # no in-place KDA kernel: the new state is copied into the buffer
            o, S = ops.kimi_delta_attention(l2_normalise(q), l2_normalise(k), v, g, beta, initial_state=update,
                                            output_final_state=True)
            update.copy_(S)
            S = None
        else:
            o, S = ops.kimi_delta_attention(l2_normalise(q), l2_normalise(k), v, g, beta, initial_state=initial_state,
                                            output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        gate = self.g_b_proj(proj("g_a_proj")).view(B, T, HV, V)
        o = (self.out_norm._normalise(o) * torch.sigmoid(gate.to(g.dtype))).to(o.dtype)
        return o, S

    def extra_repr(self) -> str:
        return super().extra_repr().replace(", gate=False", "") + f", gate_rank={self.gate_low_rank_dim}"
