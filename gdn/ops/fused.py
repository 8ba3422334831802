"""Gated DeltaNet from the layer's raw inputs: the prologue (L2-norm of q and k, β, g) fused
with the op, as one entry point (issue 3, item 3).

    o, S = gated_delta_rule_fused(q, k, v, a, b, A_log, dt_bias, *, scale=None, initial_state=None,
                                  output_final_state=False, cu_seqlens=None, use_qk_l2norm=True,
                                  allow_neg_eigval=False, backend=None)

computes ``q̂ = q·rsqrt(Σq² + 1e-6)`` (and k̂), ``g = −exp(A_log)·softplus(a + dt_bias)`` and
``β = sigmoid(b)`` (``2·sigmoid(b)`` with ``allow_neg_eigval``) in fp32, then the gated delta rule.
``backend="triton"`` runs the prologue in Triton kernels with their own backward
(:mod:`gdn.ops.triton.prologue`), checked on the H200 against the float64 reference
(docs/TRITON.md); ``backend=None`` takes them on CUDA (K and V ≥ 32). The other backends run
the prologue in PyTorch (autograd) and then :func:`gdn.ops.gated_delta_rule` with that backend.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gated_delta_rule
from ._checks import check_backend, check_recurrent

__all__ = ["gated_delta_rule_fused", "L2NORM_EPS"]

L2NORM_EPS = 1e-6


def _check_params(a, b, A_log, dt_bias):
    if not isinstance(b, torch.Tensor) or b.shape != a.shape:
        raise ValueError(f"b must have the shape of a [B, T, HV] = {list(a.shape)}, got "
                         f"{list(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
    HV = a.shape[-1]
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape [HV] = [{HV}], got {type(x).__name__}")
        if tuple(x.shape) != (HV,):
            raise ValueError(f"{name} must have shape [HV] = [{HV}], got {list(x.shape)}")
        if x.device != a.device:
            raise ValueError(f"{name} is on {x.device} but a is on {a.device}")


def _l2(x):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def gated_delta_rule_fused(q, k, v, a, b, A_log, dt_bias, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm=True, allow_neg_eigval=False, backend=None):
    """Gated DeltaNet with its prologue fused in.

    Args:
        q, k: [B, T, H, K] queries and keys (normalised here when ``use_qk_l2norm``).
        v: [B, T, HV, V] values; HV a multiple of H.
        a, b: [B, T, HV] pre-activations of the decay and of β.
        A_log, dt_bias: [HV] per-head decay parameters (fp32 math).
        scale, initial_state [N, HV, K, V], output_final_state, cu_seqlens [N + 1]: as in
            :func:`gdn.ops.gated_delta_rule`.
        use_qk_l2norm: L2-normalise q and k over K (eps 1e-6).
        allow_neg_eigval: β = 2·sigmoid(b) (transition eigenvalues in [−1, 1]).
        backend: ``None`` picks: on CUDA with Triton the Triton prologue kernels (validated on the
            H200 by ``benchmarks/gpu_check.py``), elsewhere the PyTorch prologue and then the op's
            own pick;
            ``"triton"``, ``"chunk"`` or ``"naive"`` force one.

    Returns:
        ``(o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] or None)``. Gradients reach q, k,
        v, a, b, A_log, dt_bias and initial_state.
    """
    check_backend(backend)
    check_recurrent(q, k, v, a, None, initial_state, cu_seqlens, scale, backend, name_g="a")
    _check_params(a, b, A_log, dt_bias)
    if backend is None and q.is_cuda:
        from . import _triton_module  # noqa: PLC0415

        if _triton_module() is not None:
            backend = "triton"
    if backend == "triton":
        from . import _triton_module  # noqa: PLC0415

        if not q.is_cuda or _triton_module() is None:
            raise ValueError(f"backend='triton' needs CUDA tensors (q is on {q.device}) and Triton installed; "
                             "use backend='chunk'")
        from .triton.prologue import gated_delta_rule_fused as tri  # noqa: PLC0415

        return tri(q, k, v, a, b, A_log, dt_bias, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                   allow_neg_eigval=allow_neg_eigval)
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float()) * (2.0 if allow_neg_eigval else 1.0)
    if use_qk_l2norm:
        q, k = _l2(q), _l2(k)
    return gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=backend)
