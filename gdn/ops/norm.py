"""RMSNorm and the output-gated RMSNorm of the recurrent mixers, over the last dimension.

    y = x · rstd · w                 (rms_norm)         rstd = rsqrt(mean(x²) + eps), fp32 inside
    y = x · rstd · w · SiLU(gate)    (gated_rms_norm)
    s = x + h,  y = s · rstd · w     (add_rms_norm: a residual add and the norm after it)

Both run as autograd Functions that keep only the input (in its own dtype), the gate and the fp32
``rstd`` per row for the backward, and recompute the normalised rows there: the fp32 upcasts of
the forward never outlive it. For CUDA tensors of fp16 / bf16 / fp32 both run as one Triton pass
each way (:mod:`gdn.ops.triton.rmsnorm`, same math and saved tensors); the PyTorch Functions here
are the CPU path and the reference of its tests.

Under ``torch.compile`` both are the custom op ``gdn::rms_norm`` (gate optional) with its backward
``gdn::rms_norm_backward`` (:mod:`gdn.ops.library`): the same forward and backward code, Triton or
PyTorch, with rstd passed from one to the other; nothing is recomputed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import library
from .router import HAS_TRITON, use_triton

if HAS_TRITON:
    from .triton import rmsnorm as kernels


def _f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or kept in fp64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def norm_forward(x, gate, weight, eps: float, out_dtype: torch.dtype):
    """``(y, rstd)``: ``y = x · rstd · w`` (``· SiLU(gate)`` when ``gate`` is given) in ``out_dtype``,
    rstd [..., 1] in fp32 (fp64 for fp64 x). x, gate: [..., D]; weight: [D]."""
    with torch.autocast(x.device.type, enabled=False):
        xf = _f32(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = xf * rstd * weight.to(xf.dtype)
        if gate is not None:
            y = y * F.silu(gate.to(xf.dtype))
        return y.to(out_dtype), rstd


def norm_backward(dy, x, gate, weight, rstd, need_dw: bool):
    """``(dx, dgate or None, dw or None)`` of :func:`norm_forward` from its inputs and rstd [..., 1]."""
    with torch.autocast(x.device.type, enabled=False):
        xhat = _f32(x) * rstd
        dn = dy.to(xhat.dtype)
        dgate = None
        if gate is not None:
            gf = gate.to(xhat.dtype)
            sig = torch.sigmoid(gf)
            n = xhat * weight.to(xhat.dtype)
            dgate = (dn * n * sig * (1 + gf * (1 - sig))).to(gate.dtype)  # d SiLU(g)/dg = σ(g)(1 + g(1 − σ(g)))
            dn = dn * gf * sig
        dw = (dn * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype) if need_dw else None
        dxhat = dn * weight.to(xhat.dtype)
        dx = (rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
    return dx, dgate, dw


class RMSNormFn(torch.autograd.Function):
    """``y = x · rstd · w`` with ``rstd = rsqrt(mean(x²) + eps)`` over the last dim, in fp32 (fp64 stays fp64).

    x: [..., D]; weight: [D]. Saves x, weight and rstd [..., 1] (fp32)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype: torch.dtype):
        y, rstd = norm_forward(x, None, weight, eps, out_dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, _, dw = norm_backward(dy, x, None, weight, rstd, ctx.needs_input_grad[1])
        return dx, dw, None, None


class GatedRMSNormFn(torch.autograd.Function):
    """``y = x · rstd · w · SiLU(gate)`` in fp32, returned in x.dtype.

    x, gate: [..., D]; weight: [D]. Saves x, gate, weight and rstd [..., 1] (fp32)."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps: float):
        y, rstd = norm_forward(x, gate, weight, eps, x.dtype)
        ctx.save_for_backward(x, gate, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        dx, dgate, dw = norm_backward(dy, x, gate, weight, rstd, ctx.needs_input_grad[2])
        return dx, dgate, dw, None


def _kernels_take(x: torch.Tensor) -> bool:
    return use_triton(x) and x.dtype in kernels.DTYPES


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """x: [..., D]; weight: [D] -> ``x · rstd · weight`` [..., D] in ``out_dtype``."""
    if library.compiling():
        return _norm_op(x, None, weight, float(eps), out_dtype)[0]
    if _kernels_take(x):
        return kernels.rms_norm(x, weight, eps, out_dtype)
    return RMSNormFn.apply(x, weight, eps, out_dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate: [..., D]; weight: [D] -> ``x · rstd · weight · SiLU(gate)`` [..., D] in x.dtype."""
    if library.compiling():
        return _norm_op(x, gate, weight, float(eps), x.dtype)[0]
    if _kernels_take(x):
        return kernels.gated_rms_norm(x, gate, weight, eps)
    return GatedRMSNormFn.apply(x, gate, weight, eps)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, y)``: the residual stream ``s = x + h`` and ``y = rms_norm(s)`` in ``out_dtype``. One
    kernel each way (:func:`gdn.ops.triton.rmsnorm.add_rms_norm`) where the norm's kernels run, x
    and h share a shape and x's dtype holds h's (the decode step; the training step's fp32 stream
    plus a bf16 block output); the two ops otherwise. The kernel rounds s to x's dtype before
    normalising it, as the two ops do."""
    if (not library.compiling() and _kernels_take(x) and h.shape == x.shape
            and torch.promote_types(x.dtype, h.dtype) == x.dtype):
        return kernels.add_rms_norm(x, h, weight, eps, out_dtype)
    s = x + h
    return s, rms_norm(s, weight, eps, out_dtype)


# ---- the custom ops (torch.compile) -------------------------------------------------------------
# rstd travels between the two ops as [R] (one per row of x viewed as [R, D]); in fp32, fp64 for fp64 x.

@torch.library.custom_op("gdn::rms_norm", mutates_args=())
def _norm_op(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [..., D], rstd [R]): :func:`rms_norm`, or :func:`gated_rms_norm` when ``gate`` is given."""
    if _kernels_take(x):
        return kernels._forward(x, gate, weight.contiguous(), eps, out_dtype)[:2]
    y, rstd = norm_forward(x, gate, weight, eps, out_dtype)
    return y, rstd.reshape(-1)


@_norm_op.register_fake
def _(x, gate, weight, eps, out_dtype):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(rows, dtype=torch.promote_types(x.dtype, torch.float32))


@torch.library.custom_op("gdn::rms_norm_backward", mutates_args=())
def _norm_backward_op(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor,
                      rstd: torch.Tensor, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dgate (empty without a gate), dw (empty unless ``need_dw``)) of ``gdn::rms_norm``."""
    if _kernels_take(x):
        dx, dg, dw = kernels._backward(dy, x, gate, weight.contiguous(), rstd)
        dw = dw.to(weight.dtype)
    else:
        dx, dg, dw = norm_backward(dy, x, gate, weight, rstd.view(*x.shape[:-1], 1), need_dw)
    return dx, (dg if dg is not None else x.new_empty(0)), (dw if need_dw else weight.new_empty(0))


@_norm_backward_op.register_fake
def _(dy, x, gate, weight, rstd, need_dw):
    dgate = gate.new_empty(gate.shape) if gate is not None else x.new_empty(0)
    return x.new_empty(x.shape), dgate, weight.new_empty(weight.shape if need_dw else (0,))


def _norm_setup(ctx, inputs, output):
    x, gate, weight, _, _ = inputs
    ctx.save_for_backward(x, gate, weight, output[1])


def _norm_grad(ctx, dy, _drstd):
    x, gate, weight, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dg, dw = _norm_backward_op(dy, x, gate, weight, rstd, need[2])
    return dx, (dg if gate is not None and need[1] else None), (dw if need[2] else None), None, None


_norm_op.register_autograd(_norm_grad, setup_context=_norm_setup)
