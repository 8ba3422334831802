"""Causal depthwise short convolution with a rolling state for decoding.

On CUDA the convolution of T > 1 tokens runs as Triton kernels on the [B, T, D] layout
(:mod:`gdn.ops.triton.short_conv`); the PyTorch code here is the CPU path, the one-token decode
step and the reference of those kernels' tests.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import triton_kernels


def _seq_position(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For packed offsets [N+1]: (index within its sequence [T], sequence index [T]) of every token."""
    t = torch.arange(T, device=cu_seqlens.device)
    seq = torch.bucketize(t, cu_seqlens[1:].long(), right=True)
    return t - cu_seqlens.long()[seq], seq


def _conv_act(x, weight, hist, cu_seqlens, activation):
    """The convolution and its activation. x: [B, T, D]; weight: [D, K]; hist: [B, D, K-1] (the
    inputs before ``x``; None with ``cu_seqlens`` [N+1], where each sequence starts from zeros).
    Returns y [B, T, D]."""
    T, D = x.shape[1], x.shape[2]
    K = weight.shape[1]
    w = weight.to(x.dtype)
    if cu_seqlens is not None:
        pos, _ = _seq_position(cu_seqlens, T)
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


def _tail_state(x, hist, W):
    """The last K-1 inputs [B, D, K-1] once ``x`` [B, T, D] follows ``hist`` [B, D, K-1]."""
    xp = torch.cat([hist, x.transpose(1, 2)], dim=-1)
    return xp[..., xp.shape[-1] - W:].contiguous()


def _packed_state(x, cu_seqlens, W):
    """The last K-1 inputs [N, D, K-1] of each sequence packed in ``x`` [1, T, D] (zeros before its start)."""
    bounds = cu_seqlens.long()
    starts, ends = bounds[:-1], bounds[1:]
    cols = ends[:, None] - W + torch.arange(W, device=x.device)[None, :]  # [N, K-1]
    ok = cols >= starts[:, None]
    state = x[0][cols.clamp(min=0)] * ok[..., None].to(x.dtype)  # [N, K-1, D]
    return state.transpose(1, 2).contiguous()


class _ConvActFn(torch.autograd.Function):
    """:func:`_conv_act` keeping only its inputs for the backward (x, the weight, the history), not
    the padded copy of x nor the pre-activation: the backward recomputes both (one short
    convolution) under the autocast state of the forward."""

    @staticmethod
    def forward(ctx, x, weight, hist, cu_seqlens, activation):
        dev = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.activation = activation
        ctx.save_for_backward(x, weight, hist, cu_seqlens)
        return _conv_act(x, weight, hist, cu_seqlens, activation)

    @staticmethod
    def backward(ctx, dy):
        x, weight, hist, cu_seqlens = ctx.saved_tensors
        ins = [None if t is None else t.detach().requires_grad_(need)
               for t, need in zip((x, weight, hist), ctx.needs_input_grad[:3])]
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
            y = _conv_act(*ins, cu_seqlens, ctx.activation)
        wrt = [t for t in ins if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(y, wrt, dy) if wrt else ())
        return (*(next(grads) if t is not None and t.requires_grad else None for t in ins), None, None)


class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution over time (kernel ``K``, default 4), optionally followed by SiLU.

    ``y_t = act(Σ_{i<K} w[:, K-1-i] · x_{t-i})``, with ``x`` zero before the start of each
    sequence (or taken from the conv ``state`` when continuing a cached sequence).

    Args:
        dim: channels D.
        kernel_size: K ≥ 1.
        activation: ``"silu"`` or None.

    Forward:
        x: [B, T, D]; mask: [B, T] (1 = token, 0 = padding; padded inputs are zeroed, so nothing
        leaks from them); cu_seqlens: [N+1] packed offsets (B == 1; each sequence starts from
        zeros); state: [B, D, K-1], the last K-1 inputs of the previous call (not with cu_seqlens);
        output_state: also return the new state [N, D, K-1] (N = B or the packed count).
    Returns ``(y [B, T, D], state or None)``.
    """

    def __init__(self, dim: int, kernel_size: int = 4, activation: str | None = "silu"):
        super().__init__()
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not isinstance(kernel_size, int) or kernel_size < 1:
            raise ValueError(f"kernel_size must be a positive int, got {kernel_size!r}")
        if activation not in ("silu", None):
            raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
        self.dim, self.kernel_size, self.activation = dim, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(dim, kernel_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyTorch's Conv1d default: uniform in ±1/sqrt(K)."""
        bound = 1.0 / math.sqrt(self.kernel_size)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)

    def init_value(self) -> torch.Tensor:
        """A freshly initialised weight [D, K] (used by the model's weight initialisation)."""
        bound = 1.0 / math.sqrt(self.kernel_size)
        return torch.empty_like(self.weight, device="cpu").uniform_(-bound, bound)

    def forward(self, x, mask=None, cu_seqlens=None, state=None, output_state=False):
        """x: [B, T, D] -> (y [B, T, D], state [N, D, K-1] or None)."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape [B, T, {self.dim}], got {tuple(x.shape)}")
        B, T, D = x.shape
        W = self.kernel_size - 1
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        if cu_seqlens is not None:
            if state is not None:
                raise ValueError("state cannot be combined with cu_seqlens: packed sequences start from zeros")
            hist = None
        else:
            if state is not None and tuple(state.shape) != (B, D, W):
                raise ValueError(f"state must have shape [B, D, K-1] = [{B}, {D}, {W}], got {tuple(state.shape)}")
            hist = state.to(x.dtype) if state is not None else None
        tri = triton_kernels("short_conv", x) if cu_seqlens is not None or T > 1 else None
        if tri is not None:  # reads no history when there is none
            y = tri.short_conv(x, self.weight, hist, cu_seqlens, self.activation)
        else:
            if hist is None and cu_seqlens is None:
                hist = x.new_zeros(B, D, W)
            if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, self.weight, hist)):
                y = _ConvActFn.apply(x, self.weight, hist, cu_seqlens, self.activation)
            else:
                y = _conv_act(x, self.weight, hist, cu_seqlens, self.activation)
        new_state = None
        if output_state:
            if cu_seqlens is not None:
                new_state = _packed_state(x, cu_seqlens, W)
            else:
                new_state = _tail_state(x, hist if hist is not None else x.new_zeros(B, D, W), W)
        return y, new_state

    def extra_repr(self) -> str:
        return f"{self.dim}, kernel_size={self.kernel_size}, activation={self.activation}"
