"""The gate, write-strength and key-normalisation formulas, in one place.

Every layer, fused entry point, compat shim and kernel wrapper computes these through this
module (the Triton prologue kernels compute the same formulas on the GPU with :data:`L2NORM_EPS`)::

    g = −exp(A_log) · softplus(a + dt_bias)        scalar_decay: [B, T, HV], one decay per head
    g = −exp(A_log_h) · softplus(f + dt_bias)      kda_gate:     [B, T, HV, K], one per key channel
    β = sigmoid(b)   (2·sigmoid(b) to allow negative eigenvalues of the transition)
    x̂ = x · (Σ x² + eps)^(−1/2)                    l2_normalise over the head dimension

Gates are computed in fp32 (fp64 stays fp64): they are exponentiated and summed over a chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["L2NORM_EPS", "l2_normalise", "scalar_decay", "kda_gate", "write_strength"]

#: Epsilon of the L2 normalisation of queries and keys (inside the square root).
L2NORM_EPS = 1e-6


def _f32(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


class _L2Normalise(torch.autograd.Function):
    """y = x · r with r = (Σ x² + eps)^(-1/2) over the last dim, computed in fp32 (fp64 stays fp64).
    Keeps x (its own dtype) and r ([..., 1]) for the backward instead of fp32 copies of x:
    dx = r · dy − r³ · x · Σ (x · dy)."""

    @staticmethod
    def forward(ctx, x, eps):
        xf = x.to(_f32(x))
        r = torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r)
        return (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, r = ctx.saved_tensors
        xf, dyf = x.to(r.dtype), dy.to(r.dtype)
        dx = r * dyf - (r ** 3) * xf * (xf * dyf).sum(-1, keepdim=True)
        return dx.to(x.dtype), None


def l2_normalise(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / ‖x‖ over the last dim (fp32 inside, in x.dtype out); zero rows stay zero.
    [..., D] -> [..., D]. Keeps only x and one fp32 number per row for the backward."""
    return _L2Normalise.apply(x, eps)


def scalar_decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Mamba2-style log decay ``g = −exp(A_log) · softplus(a + dt_bias)`` in fp32.
    a: [B, T, HV]; A_log, dt_bias: [HV] -> [B, T, HV]."""
    dt = _f32(a)
    return -torch.exp(A_log.to(dt)) * F.softplus(a.to(dt) + dt_bias.to(dt))


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Per-channel log decay ``g = −exp(A_log_h) · softplus(f + dt_bias)`` in fp32 (fp64 for fp64 f).
    f: [B, T, HV, K]; A_log: [HV]; dt_bias: [HV·K] -> [B, T, HV, K]."""
    HV, K = f.shape[-2], f.shape[-1]
    dt = _f32(f)
    return -torch.exp(A_log.to(dt)).view(HV, 1) * F.softplus(f.to(dt) + dt_bias.to(dt).view(HV, K))


def write_strength(b: torch.Tensor, allow_neg_eigval: bool = False) -> torch.Tensor:
    """``β = sigmoid(b)`` in fp32, doubled with ``allow_neg_eigval`` (transition eigenvalues in
    [−1, 1]). b: [B, T, HV] -> [B, T, HV]."""
    beta = torch.sigmoid(b.to(_f32(b)))
    return beta * 2.0 if allow_neg_eigval else beta
