"""Normalisation blocks: RMSNorm and the output-gated RMSNorm of the recurrent mixers.

Both run as autograd Functions that keep only the input (in its own dtype), the gate and the fp32
``rstd`` per row for the backward, and recompute the normalised rows there: the fp32 upcasts of
the forward never outlive it. On CUDA (fp16 / bf16 / fp32 inputs) both run as one Triton pass
each way (:mod:`gdn.ops.triton.rmsnorm`, same math and saved tensors); these PyTorch Functions are
the CPU path and the reference of its tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import triton_kernels


def _f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or kept in fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _triton_norm(x: torch.Tensor):
    """:mod:`gdn.ops.triton.rmsnorm` for a CUDA ``x`` of a dtype it takes, else None."""
    tri = triton_kernels("rmsnorm", x)
    return tri if tri is not None and x.dtype in tri.DTYPES else None


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype active for ``x``'s device, or None when autocast is off there."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


class _RMSNormFn(torch.autograd.Function):
    """``y = x · rstd · w`` with ``rstd = rsqrt(mean(x²) + eps)`` over the last dim, in fp32 (fp64 stays fp64).

    x: [..., D]; weight: [D]. Saves x, weight and rstd [..., 1] (fp32)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype: torch.dtype):
        with torch.autocast(x.device.type, enabled=False):
            xf = _f32(x)
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y = (xf * rstd * weight.to(xf.dtype)).to(out_dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            xhat = _f32(x) * rstd
            dyf = dy.to(xhat.dtype)
            dw = (dyf * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
            dxhat = dyf * weight.to(xhat.dtype)
            dx = (rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dw, None, None


class _GatedRMSNormFn(torch.autograd.Function):
    """``y = x · rstd · w · SiLU(gate)`` in fp32, returned in x.dtype.

    x, gate: [..., D]; weight: [D]. Saves x, gate, weight and rstd [..., 1] (fp32)."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps: float):
        with torch.autocast(x.device.type, enabled=False):
            xf = _f32(x)
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y = (xf * rstd * weight.to(xf.dtype) * F.silu(gate.to(xf.dtype))).to(x.dtype)
        ctx.save_for_backward(x, gate, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            xhat = _f32(x) * rstd
            gf = gate.to(xhat.dtype)
            sig = torch.sigmoid(gf)
            dyf = dy.to(xhat.dtype)
            n = xhat * weight.to(xhat.dtype)
            dgate = (dyf * n * sig * (1 + gf * (1 - sig))).to(gate.dtype)  # d SiLU(g)/dg = σ(g)(1 + g(1 − σ(g)))
            dn = dyf * gf * sig
            dw = (dn * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype) if ctx.needs_input_grad[2] else None
            dxhat = dn * weight.to(xhat.dtype)
            dx = (rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dgate, dw, None


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32: ``x / rms(x) · weight``.

    Args:
        dim: size D of the normalised (last) dimension.
        eps: added to the mean square before the square root.

    Shapes: ``x`` [..., D] -> [..., D] in ``x.dtype``, or in the autocast dtype when autocast is on
    for ``x``'s device (its consumers are the projections, which would cast it anyway; one
    low-precision copy is then shared by all of them instead of one per projection).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight._no_weight_decay = True

    def _check(self, name: str, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [..., {self.weight.shape[0]}], got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"{name} must have shape [..., {self.weight.shape[0]}], got {tuple(x.shape)}")

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> ``x · rstd · weight`` [..., D] in fp32, through plain autograd (for a caller
        that goes on combining it in fp32, as the KDA output gate does)."""
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> [..., D]."""
        self._check("x", x)
        out_dtype = _autocast_dtype(x) or x.dtype
        tri = _triton_norm(x)
        if tri is not None:
            return tri.rms_norm(x, self.weight, self.eps, out_dtype)
        return _RMSNormFn.apply(x, self.weight, self.eps, out_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(RMSNorm):
    """RMSNorm of ``x`` times ``SiLU(gate)``: the output block of Gated DeltaNet (per head).

    Shapes: ``x``, ``gate`` [..., D] -> [..., D] in ``x.dtype`` (fp32 inside).
    """

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x, gate: [..., D] -> [..., D]."""
        self._check("x", x)
        if not isinstance(gate, torch.Tensor) or gate.shape != x.shape:
            raise ValueError(f"gate must have the shape of x {tuple(x.shape)}, got "
                             f"{tuple(gate.shape) if isinstance(gate, torch.Tensor) else type(gate).__name__}")
        tri = _triton_norm(x)
        if tri is not None:
            return tri.gated_rms_norm(x, gate, self.weight, self.eps)
        return _GatedRMSNormFn.apply(x, gate, self.weight, self.eps)
