"""The SwiGLU feed-forward's activation, product and down projection: ``down(SiLU(gate) · up)``.

One autograd Function keeps only the outputs of the gate and up projections (and the weight) for
the backward and recomputes the product there. The elementwise parts run as one Triton pass each
way for CUDA tensors (:mod:`gdn.ops.triton.swiglu`), two PyTorch kernels elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .router import HAS_TRITON, use_triton

if HAS_TRITON:
    from .triton import swiglu as kernels


def _product(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiLU(g) · u: one Triton pass on CUDA (fp32 math, rounded once), two PyTorch kernels elsewhere."""
    return kernels.swiglu_forward(g, u) if use_triton(g) else F.silu(g) * u


class SwiGLUDownFn(torch.autograd.Function):
    """``F.linear(SiLU(gate) · up, weight)`` keeping gate, up and the weight itself for the backward,
    not SiLU(gate) nor the product: the backward recomputes them. On CUDA the elementwise parts
    run as one Triton pass each way (:mod:`gdn.ops.triton.swiglu`).

    gate, up: [..., I]; weight: [D, I], cast to ``dtype`` (the dtype the product runs in).
    Returns [..., D] in ``dtype``."""

    @staticmethod
    def forward(ctx, gate, up, weight, dtype: torch.dtype):
        with torch.autocast(gate.device.type, enabled=False):
            h = _product(gate.to(dtype), up.to(dtype))
            y = F.linear(h, weight.to(dtype))
        ctx.save_for_backward(gate, up, weight)
        ctx.dtype = dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        dt = ctx.dtype
        with torch.autocast(gate.device.type, enabled=False):
            g, u, w, dy = gate.to(dt), up.to(dt), weight.to(dt), dy.to(dt)
            dw = None
            if ctx.needs_input_grad[2]:
                h = _product(g, u)
                dw = (dy.reshape(-1, dy.shape[-1]).t() @ h.reshape(-1, h.shape[-1])).to(weight.dtype)
                del h
            dh = dy @ w
            if use_triton(g):
                dgate, dup = kernels.swiglu_backward(dh, g, u)
                dgate, dup = dgate.to(gate.dtype), dup.to(up.dtype)
            else:
                dgate = torch.ops.aten.silu_backward(dh * u, g).to(gate.dtype)
                dup = (dh * F.silu(g)).to(up.dtype)
        return dgate, dup, dw, None


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(SiLU(gate) · up, weight)`` computed in ``dtype``. gate, up: [..., I]; weight: [D, I].
    Returns [..., D] in ``dtype``."""
    return SwiGLUDownFn.apply(gate, up, weight, dtype)
