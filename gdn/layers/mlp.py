"""SwiGLU feed-forward block."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import triton_kernels


def _product(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiLU(g) · u: one Triton pass on CUDA (fp32 math, rounded once), two PyTorch kernels elsewhere."""
    tri = triton_kernels("swiglu", g)
    return tri.swiglu_forward(g, u) if tri is not None else F.silu(g) * u


class _SwiGLUDownFn(torch.autograd.Function):
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
            tri = triton_kernels("swiglu", g)
            dw = None
            if ctx.needs_input_grad[2]:
                h = _product(g, u)
                dw = (dy.reshape(-1, dy.shape[-1]).t() @ h.reshape(-1, h.shape[-1])).to(weight.dtype)
                del h
            dh = dy @ w
            if tri is not None:
                dgate, dup = tri.swiglu_backward(dh, g, u)
                dgate, dup = dgate.to(gate.dtype), dup.to(up.dtype)
            else:
                dgate = torch.ops.aten.silu_backward(dh * u, g).to(gate.dtype)
                dup = (dh * F.silu(g)).to(up.dtype)
        return dgate, dup, dw, None


class SwiGLU(nn.Module):
    """``down(SiLU(gate(x)) · up(x))``, no biases.

    The activation, the product and ``down`` run as one autograd Function that keeps only the
    outputs of ``gate`` and ``up`` for the backward (so ``down_proj`` is a plain weight holder:
    module hooks on it do not fire).

    Args:
        hidden_size: model width D.
        intermediate_size: inner width I.

    Shapes: ``x`` [B, T, D] -> [B, T, D] (in the autocast dtype under autocast).
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        for name, val in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]."""
        gate, up = self.gate_proj(x), self.up_proj(x)
        dev = gate.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else gate.dtype
        return _SwiGLUDownFn.apply(gate, up, self.down_proj.weight, dtype)
