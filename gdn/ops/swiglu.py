"""The SwiGLU feed-forward's activation, product and down projection: ``down(SiLU(gate) · up)``.

One autograd Function keeps only the outputs of the gate and up projections (and the weight) for
the backward and recomputes the product there. The elementwise parts run as one Triton pass each
way for CUDA tensors (:mod:`gdn.ops.triton.swiglu`), two PyTorch kernels elsewhere.

Under ``torch.compile`` :func:`swiglu_down` is the custom op ``gdn::swiglu_down`` with its backward
``gdn::swiglu_down_backward`` (:mod:`gdn.ops.library`): the Function's own forward and backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import library
from .router import HAS_TRITON, use_triton

if HAS_TRITON:
    from .triton import swiglu as kernels


def _product(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiLU(g) · u: one Triton pass on CUDA (fp32 math, rounded once), two PyTorch kernels elsewhere."""
    return kernels.swiglu_forward(g, u) if use_triton(g) else F.silu(g) * u


def swiglu_down_forward(gate, up, weight, dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(SiLU(gate) · up, weight)`` in ``dtype``. gate, up: [..., I]; weight: [D, I] -> [..., D]."""
    with torch.autocast(gate.device.type, enabled=False):
        h = _product(gate.to(dtype), up.to(dtype))
        return F.linear(h, weight.to(dtype))


def swiglu_down_backward(dy, gate, up, weight, dtype: torch.dtype, need_dw: bool, out=None):
    """``(dgate, dup, dw or None)`` of :func:`swiglu_down_forward`; the product, which dw needs, formed
    again (on CUDA by the same pass as dgate and dup). ``out``: (dgate, dup) views to write the two
    gradients into (the column blocks of one joined gradient, in gate's dtype and with gate's and
    up's strides)."""
    with torch.autocast(gate.device.type, enabled=False):
        g, u, w, dy = gate.to(dtype), up.to(dtype), weight.to(dtype), dy.to(dtype)
        dh = dy @ w
        if use_triton(g) and (out is None or g is gate):  # written in place where no cast stands between
            dgate, dup, *h = kernels.swiglu_backward(dh, g, u, out, want_h=need_dw)
            h = h[0] if h else None
            dgate, dup = dgate.to(gate.dtype), dup.to(up.dtype)
        else:
            h = _product(g, u) if need_dw else None
            dgate = torch.ops.aten.silu_backward(dh * u, g).to(gate.dtype)
            dup = (dh * F.silu(g)).to(up.dtype)
            if out is not None:
                dgate, dup = out[0].copy_(dgate), out[1].copy_(dup)
        del dh
        dw = None
        if need_dw:
            dw = (dy.reshape(-1, dy.shape[-1]).t() @ h.reshape(-1, h.shape[-1])).to(weight.dtype)
    return dgate, dup, dw


class SwiGLUDownFn(torch.autograd.Function):
    """``F.linear(SiLU(gate) · up, weight)`` keeping gate, up and the weight itself for the backward,
    not SiLU(gate) nor the product: the backward recomputes them. On CUDA the elementwise parts
    run as one Triton pass each way (:mod:`gdn.ops.triton.swiglu`).

    gate, up: [..., I]; weight: [D, I], cast to ``dtype`` (the dtype the product runs in).
    Returns [..., D] in ``dtype``."""

    @staticmethod
    def forward(ctx, gate, up, weight, dtype: torch.dtype):
        y = swiglu_down_forward(gate, up, weight, dtype)
        ctx.save_for_backward(gate, up, weight)
        ctx.dtype = dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up, weight = ctx.saved_tensors
        dgate, dup, dw = swiglu_down_backward(dy, gate, up, weight, ctx.dtype, ctx.needs_input_grad[2])
        return dgate, dup, dw, None


class SwiGLUDownJoinedFn(torch.autograd.Function):
    """:class:`SwiGLUDownFn` on one joined product ``gu`` [..., 2 I] (gate's columns, then up's):
    keeps gu, and its backward writes the gradients of the two column blocks into one [..., 2 I]
    tensor, so that gate and up from one product of their joined weights reach that product's
    backward without a copy joining their gradients."""

    @staticmethod
    def forward(ctx, gu, weight, dtype: torch.dtype):
        gate, up = gu.chunk(2, -1)
        y = swiglu_down_forward(gate, up, weight, dtype)
        ctx.save_for_backward(gu, weight)
        ctx.dtype = dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        gu, weight = ctx.saved_tensors
        gu = gu.contiguous()  # (a product's output already is)
        gate, up = gu.chunk(2, -1)
        dgu = torch.empty_like(gu)
        _, _, dw = swiglu_down_backward(dy, gate, up, weight, ctx.dtype, ctx.needs_input_grad[1],
                                        out=dgu.chunk(2, -1))
        return dgu, dw, None


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(SiLU(gate) · up, weight)`` computed in ``dtype``. gate, up: [..., I]; weight: [D, I].
    Returns [..., D] in ``dtype``."""
    if library.compiling():
        return _swiglu_op(gate, up, weight, dtype)
    return SwiGLUDownFn.apply(gate, up, weight, dtype)


def swiglu_down_joined(gu: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`swiglu_down` of gate and up given as one product ``gu`` [..., 2 I] (gate's columns
    first): its gradient comes back as one tensor, written in place by the backward (no copy joins
    the two halves' gradients). Under ``torch.compile`` the halves go to ``gdn::swiglu_down``."""
    if gu.shape[-1] % 2:
        raise ValueError(f"gu must have an even last dimension (gate's columns, then up's), got {tuple(gu.shape)}")
    if library.compiling():
        gate, up = gu.chunk(2, -1)
        return _swiglu_op(gate, up, weight, dtype)
    return SwiGLUDownJoinedFn.apply(gu, weight, dtype)


# ---- the custom ops (torch.compile) -------------------------------------------------------------

@torch.library.custom_op("gdn::swiglu_down", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return swiglu_down_forward(gate, up, weight, dtype)


@_swiglu_op.register_fake
def _(gate, up, weight, dtype):
    return gate.new_empty((*gate.shape[:-1], weight.shape[0]), dtype=dtype)


@torch.library.custom_op("gdn::swiglu_down_backward", mutates_args=())
def _swiglu_backward_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                        dtype: torch.dtype, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dgate, dup, dw (empty unless ``need_dw``))."""
    dgate, dup, dw = swiglu_down_backward(dy, gate, up, weight, dtype, need_dw)
    return dgate, dup, (dw if dw is not None else weight.new_empty(0))


@_swiglu_backward_op.register_fake
def _(dy, gate, up, weight, dtype, need_dw):
    return gate.new_empty(gate.shape), up.new_empty(up.shape), weight.new_empty(weight.shape if need_dw else (0,))


def _swiglu_setup(ctx, inputs, output):
    gate, up, weight, dtype = inputs
    ctx.save_for_backward(gate, up, weight)
    ctx.dtype = dtype


def _swiglu_grad(ctx, dy):
    gate, up, weight = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[2]
    dgate, dup, dw = _swiglu_backward_op(dy, gate, up, weight, ctx.dtype, need_dw)
    return dgate, dup, (dw if need_dw else None), None


_swiglu_op.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)
