"""RMSNorm and the output-gated RMSNorm of the recurrent mixers, over the last dimension.

    y = x · rstd · w                 (rms_norm)         rstd = rsqrt(mean(x²) + eps), fp32 inside
    y = x · rstd · w · SiLU(gate)    (gated_rms_norm)

Both run as autograd Functions that keep only the input (in its own dtype), the gate and the fp32
``rstd`` per row for the backward, and recompute the normalised rows there: the fp32 upcasts of
the forward never outlive it. For CUDA tensors of fp16 / bf16 / fp32 both run as one Triton pass
each way (:mod:`gdn.ops.triton.rmsnorm`, same math and saved tensors); the PyTorch Functions here
are the CPU path and the reference of its tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .router import HAS_TRITON, use_triton

if HAS_TRITON:
    from .triton import rmsnorm as kernels


def _f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or kept in fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class RMSNormFn(torch.autograd.Function):
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


class GatedRMSNormFn(torch.autograd.Function):
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


def _kernels_take(x: torch.Tensor) -> bool:
    return use_triton(x) and x.dtype in kernels.DTYPES


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """x: [..., D]; weight: [D] -> ``x · rstd · weight`` [..., D] in ``out_dtype``."""
    if _kernels_take(x):
        return kernels.rms_norm(x, weight, eps, out_dtype)
    return RMSNormFn.apply(x, weight, eps, out_dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate: [..., D]; weight: [D] -> ``x · rstd · weight · SiLU(gate)`` [..., D] in x.dtype."""
    if _kernels_take(x):
        return kernels.gated_rms_norm(x, gate, weight, eps)
    return GatedRMSNormFn.apply(x, gate, weight, eps)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype active for ``x``'s device, or None when autocast is off there."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
