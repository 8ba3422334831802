"""Causal depthwise short convolution (+ SiLU) over [B, T, D], with a history for decoding.

``y_t = act(Σ_{i<K} w[:, K-1-i] · x_{t-i})`` with x zero before each sequence's start (or taken
from the history ``hist`` [B, D, K-1] when continuing a cached sequence). :func:`short_conv`
runs the Triton kernels (:mod:`gdn.ops.triton.short_conv`) for CUDA tensors of more than one
token, else the PyTorch functions here (the CPU path, the one-token decode step and the reference
of the kernels' tests).

Under ``torch.compile`` :func:`short_conv` is the custom op ``gdn::short_conv``
(:mod:`gdn.ops.library`) whose backward recomputes the convolution and differentiates it: on the
CPU what the eager backward does too, on CUDA one extra pass of the forward kernel per backward.
:func:`conv_state` is plain PyTorch and traced.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import library, offsets
from .router import HAS_TRITON, use_triton

if HAS_TRITON:
    from .triton import short_conv as kernels


def seq_position(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For packed offsets [N+1]: (index within its sequence [T], sequence index [T]) of every token
    (made once per offsets tensor: :mod:`gdn.ops.offsets`; not to be modified)."""
    return offsets.memo(cu_seqlens, ("seq_position", T), lambda: _seq_position(cu_seqlens, T))


def _seq_position(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(T, device=cu_seqlens.device)
    seq = torch.bucketize(t, cu_seqlens[1:].long(), right=True)
    return t - cu_seqlens.long()[seq], seq


def conv_act(x, weight, hist, cu_seqlens, activation):
    """The convolution and its activation. x: [B, T, D]; weight: [D, K]; hist: [B, D, K-1] (the
    inputs before ``x``; None with ``cu_seqlens`` [N+1], where each sequence starts from zeros).
    Returns y [B, T, D]."""
    T, D = x.shape[1], x.shape[2]
    K = weight.shape[1]
    w = weight.to(x.dtype)
    if cu_seqlens is not None:
        pos, _ = seq_position(cu_seqlens, T)
        y = torch.zeros_like(x)
        for i in range(K):  # tap i reads x_{t-i}, valid only inside the token's own sequence
            shifted = F.pad(x, (0, 0, i, 0))[:, :T] if i else x
            valid = (pos >= i).to(x.dtype)[None, :, None]
            y = y + shifted * valid * w[:, K - 1 - i]
    else:
        xp = torch.cat([hist, x.transpose(1, 2)], dim=-1)  # [B, D, K-1 + T]
        if T == 1:  # decode step: one dot product per channel, cheaper than a conv launch
            y = (xp * w).sum(-1)[:, None]
        else:
            y = F.conv1d(xp, w[:, None, :], groups=D).transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


def tail_state(x, hist, W):
    """The last K-1 inputs [B, D, K-1] once ``x`` [B, T, D] follows ``hist`` [B, D, K-1]."""
    xp = torch.cat([hist, x.transpose(1, 2)], dim=-1)
    return xp[..., xp.shape[-1] - W:].contiguous()


def packed_state(x, cu_seqlens, W):
    """The last K-1 inputs [N, D, K-1] of each sequence packed in ``x`` [1, T, D] (zeros before its start)."""
    bounds = cu_seqlens.long()
    starts, ends = bounds[:-1], bounds[1:]
    cols = ends[:, None] - W + torch.arange(W, device=x.device)[None, :]  # [N, K-1]
    ok = cols >= starts[:, None]
    state = x[0][cols.clamp(min=0)] * ok[..., None].to(x.dtype)  # [N, K-1, D]
    return state.transpose(1, 2).contiguous()


class ConvActFn(torch.autograd.Function):
    """:func:`conv_act` keeping only its inputs for the backward (x, the weight, the history), not
    the padded copy of x nor the pre-activation: the backward recomputes both (one short
    convolution) under the autocast state of the forward."""

    @staticmethod
    def forward(ctx, x, weight, hist, cu_seqlens, activation):
        dev = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.activation = activation
        ctx.save_for_backward(x, weight, hist, cu_seqlens)
        return conv_act(x, weight, hist, cu_seqlens, activation)

    @staticmethod
    def backward(ctx, dy):
        x, weight, hist, cu_seqlens = ctx.saved_tensors
        ins = [None if t is None else t.detach().requires_grad_(need)
               for t, need in zip((x, weight, hist), ctx.needs_input_grad[:3])]
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
            y = conv_act(*ins, cu_seqlens, ctx.activation)
        wrt = [t for t in ins if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(y, wrt, dy) if wrt else ())
        return (*(next(grads) if t is not None and t.requires_grad else None for t in ins), None, None)


def short_conv(x, weight, hist, cu_seqlens, activation):
    """The convolution and its activation on the fastest path. x: [B, T, D]; weight: [D, K];
    hist: [B, D, K-1] or None (zeros; always None with ``cu_seqlens`` [N+1]); activation:
    ``"silu"`` or None. Returns y [B, T, D] in x.dtype."""
    if library.compiling():
        return _conv_op(x, weight, hist, cu_seqlens, activation == "silu", library.autocast_of(x))
    B, T, D = x.shape
    if use_triton(x) and (cu_seqlens is not None or T > 1):  # reads no history when there is none
        return kernels.short_conv(x, weight, hist, cu_seqlens, activation)
    if hist is None and cu_seqlens is None:
        hist = x.new_zeros(B, D, weight.shape[1] - 1)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, hist)):
        return ConvActFn.apply(x, weight, hist, cu_seqlens, activation)
    return conv_act(x, weight, hist, cu_seqlens, activation)


def short_conv_group(xs, weights, hist, cu_seqlens, activation):
    """:func:`short_conv` of two or three inputs at once (``xs[i]`` [B, T, D_i] with ``weights[i]``
    [D_i, K]; ``hist`` [B, ΣD_i, K-1] or None) where the Triton kernels take them and the inputs are
    adjacent column blocks of one tensor (a mixer's q, k, v in its joined projections): one forward
    and one backward launch, one autograd node, instead of one each. Returns the outputs, or None
    where they must run one by one (another device, under ``torch.compile``, blocks not side by side)."""
    if library.compiling() or not _kernels_take(xs[0], cu_seqlens):
        return None
    return kernels.short_conv_group(xs, weights, hist, cu_seqlens, activation)


def _kernels_take(x, cu_seqlens) -> bool:
    """:func:`short_conv`'s rule (inlined there: its eager path is host-bound on the GPU)."""
    return use_triton(x) and (cu_seqlens is not None or x.shape[1] > 1)


def _conv_run(x, weight, hist, cu_seqlens, silu: bool, autocast):
    """``(y,)``: :func:`short_conv` as ``gdn::short_conv`` runs it (the kernels, or :func:`conv_act`
    itself rather than its Function: the op's backward recomputes and differentiates this)."""
    activation = "silu" if silu else None
    with library.autocast_as(x.device.type, autocast):
        if _kernels_take(x, cu_seqlens):
            return (kernels.short_conv(x, weight, hist, cu_seqlens, activation),)
        if hist is None and cu_seqlens is None:
            hist = x.new_zeros(x.shape[0], x.shape[2], weight.shape[1] - 1)
        return (conv_act(x, weight, hist, cu_seqlens, activation).contiguous(),)


def _conv_fake(x, weight, hist, cu_seqlens, silu, autocast):
    # autocast changes the dtype where a convolution runs: the unpacked path of more than one token
    dtype = autocast if autocast is not None and cu_seqlens is None and x.shape[1] > 1 else x.dtype
    return (x.new_empty(x.shape, dtype=dtype),)


_conv_op = library.recomputed_op(
    "short_conv", "Tensor x, Tensor weight, Tensor? hist, Tensor? cu_seqlens, bool silu, ScalarType? autocast",
    1, _conv_run, _conv_fake, differentiable=(0, 1, 2))


def conv_step_(x, weight, tails, activation, bias=None):
    """One token per row: x [B, 1, D] after the inputs ``tails`` [B, D, K-1] (updated in place to the
    last K-1 inputs, x included); weight [D, K]; bias [D] or None. Returns y [B, 1, D] in x.dtype, the
    numbers of :func:`short_conv` with ``hist=tails`` (same products, same sum, oldest tap first)
    and no allocation kept.

    Where :func:`gdn.ops.router.use_triton` says so and ``tails`` is contiguous, one kernel does it
    all (:func:`gdn.ops.triton.short_conv.conv_step_`: x read in place, fp32 sum and activation,
    one rounding); otherwise PyTorch ops in x's dtype. Inference only."""
    if use_triton(x) and x.dtype in kernels.DTYPES and tails.is_contiguous():
        return kernels.conv_step_(x, weight, tails, activation, bias)
    xp = torch.cat([tails.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, D, K]
    y = (xp * weight.to(x.dtype)).sum(-1)[:, None]
    tails.copy_(xp[..., 1:])
    if bias is not None:
        y = y + bias.to(x.dtype)
    return F.silu(y) if activation == "silu" else y


def conv_state(x, hist, cu_seqlens, W: int):
    """The history after ``x`` [B, T, D]: its last W = K-1 inputs [N, D, W] per sequence (zeros
    before a sequence's start); ``hist`` [B, D, W] precedes x (None: zeros; not with ``cu_seqlens``)."""
    if cu_seqlens is not None:
        return packed_state(x, cu_seqlens, W)
    return tail_state(x, hist if hist is not None else x.new_zeros(x.shape[0], x.shape[2], W), W)
