"""SwiGLU's elementwise part in one pass each way: ``h = SiLU(gate) · up`` and its backward.

PyTorch runs ``F.silu(gate) * up`` as two kernels forward and the backward's SiLU, products and
``silu_backward`` as five, each a full pass over [tokens, intermediate] tensors; these kernels
read their inputs once and write their outputs once, computing in fp32.

    h = swiglu_forward(gate, up)                  # gate, up: same shape and dtype -> h in that dtype
    dgate, dup = swiglu_backward(dh, gate, up)    # d/dgate = dh·up·σ(g)(1 + g(1 − σ(g))), d/dup = dh·SiLU(g)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tuning import OTHER



@triton.jit
def _swiglu_fwd_kernel(g, u, h, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    b_g = tl.load(g + offs, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u + offs, mask=m, other=0.0).to(tl.float32)
    b_h = b_g * tl.sigmoid(b_g) * b_u
    tl.store(h + offs, b_h.to(h.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(dh, g, u, dg, du, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    b_dh = tl.load(dh + offs, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(g + offs, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u + offs, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(b_g)
    tl.store(dg + offs, (b_dh * b_u * sig * (1.0 + b_g * (1.0 - sig))).to(dg.dtype.element_ty), mask=m)
    tl.store(du + offs, (b_dh * b_g * sig).to(du.dtype.element_ty), mask=m)


def _check(name: str, ref: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.shape != ref.shape or x.dtype != ref.dtype or x.device != ref.device:
        raise ValueError(f"{name} must match gate in shape, dtype and device ({tuple(ref.shape)}, {ref.dtype}, "
                         f"{ref.device}), got {tuple(x.shape)}, {x.dtype}, {x.device}")
    return x.contiguous()


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up, in gate's dtype (fp32 math). gate, up: any shape, same dtype and device."""
    gate = gate.contiguous()
    up = _check("up", gate, up)
    h = torch.empty_like(gate)
    n = gate.numel()
    if n:
        c = OTHER["swiglu"]
        _swiglu_fwd_kernel[(triton.cdiv(n, c["BLOCK"]),)](gate, up, h, n, BLOCK=c["BLOCK"], num_warps=c["num_warps"])
    return h


def swiglu_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of h = SiLU(gate) · up given dh; all of one shape, dtype and device."""
    gate = gate.contiguous()
    up, dh = _check("up", gate, up), _check("dh", gate, dh)
    dg, du = torch.empty_like(gate), torch.empty_like(gate)
    n = gate.numel()
    if n:
        c = OTHER["swiglu"]
        _swiglu_bwd_kernel[(triton.cdiv(n, c["BLOCK"]),)](dh, gate, up, dg, du, n, BLOCK=c["BLOCK"],
                                                          num_warps=c["num_warps"])
    return dg, du
