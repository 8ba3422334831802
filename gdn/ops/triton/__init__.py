"""Triton GPU backend of :mod:`gdn.ops` (``backend="triton"``).

``AVAILABLE`` is True when Triton imports. The four recurrent members take the contract of
:mod:`gdn.ops.reference` (arguments already validated by :mod:`gdn.ops`):

    o, S = gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens)

q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; initial_state: [N, HV, K, V];
cu_seqlens: [N + 1]; o comes back in v.dtype, the final state in fp32.

Calls with T ≤ ``RECURRENT_MAX_T`` tokens that need no gradient go to the fused recurrent
kernel (:mod:`.fused_recurrent`, when present); everything else runs the chunk kernels
(:mod:`.chunk`), which support autograd. ``gated_delta_rule_fused`` and friends (:mod:`.prologue`)
take the layer's raw inputs and compute L2-norm, β and g on the GPU.
"""
from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - exercised on machines without triton
    AVAILABLE = False
else:
    AVAILABLE = True

__all__ = ["AVAILABLE"]

if AVAILABLE:
    import torch

    from .chunk import chunk_op

    try:
        from . import fused_recurrent as _recurrent
    except ImportError:  # the decode kernels are optional for the chunk path
        _recurrent = None

    RECURRENT_MAX_T = 64  # tokens: below this the sequential kernel beats the chunk pipeline

    def _use_recurrent(q, k, v, g, beta, initial_state) -> bool:
        if _recurrent is None or q.shape[1] > RECURRENT_MAX_T:
            return False
        if any(x is not None and x.dtype not in (torch.float32, torch.float16, torch.bfloat16) for x in (q, k, v)):
            return False
        if max(q.shape[-1], v.shape[-1]) > getattr(_recurrent, "MAX_HEAD_DIM", 0):
            return False
        needs_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
        return not needs_grad

    # torch.compile treats the kernels as opaque calls (a graph break): dynamo cannot trace their
    # launch helpers, and there is nothing for it to fuse inside them
    @torch.compiler.disable
    def _run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
        if _use_recurrent(q, k, v, g, beta, initial_state):
            return _recurrent.fused_recurrent_gated_delta_rule(
                q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        return chunk_op(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state, cu_seqlens=cu_seqlens)

    def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None):
        """Gated DeltaNet ``S = exp(g)(I − β k kᵀ) S + β k vᵀ``, ``o = scale Sᵀ q`` (shapes above)."""
        return _run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)

    def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
        """DeltaNet ``S = (I − β k kᵀ) S + β k vᵀ``: the gated kernels with the gate compiled out."""
        return _run(q, k, v, None, beta, scale, initial_state, output_final_state, cu_seqlens)

    def gated_linear_attention(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None):
        """Gated linear attention ``S = exp(g) S + k vᵀ``: no delta term (no triangular solve)."""
        return _run(q, k, v, g, None, scale, initial_state, output_final_state, cu_seqlens)

    def linear_attention(q, k, v, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
        """Linear attention ``S += k vᵀ``."""
        return _run(q, k, v, None, None, scale, initial_state, output_final_state, cu_seqlens)

    from .prologue import gated_delta_rule_fused  # noqa: E402 - needs _run above

    __all__ += ["gated_delta_rule", "delta_rule", "gated_linear_attention", "linear_attention", "chunk_op",
                "gated_delta_rule_fused", "RECURRENT_MAX_T"]
