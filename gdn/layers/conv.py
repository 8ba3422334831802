"""Causal depthwise short convolution with a rolling state for decoding (the op:
:func:`gdn.ops.conv.short_conv`)."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..distributed import halo as exchange_halo
from ..ops.conv import conv_state, short_conv, short_conv_group


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
        context_parallel: a :class:`gdn.distributed.ContextParallel`: x is this rank's slice of
        a sequence split across ranks (its layout, also the packed offsets, comes from it; no
        mask, cu_seqlens, state or output_state); the K-1 inputs before the slice come from the
        previous rank, or as ``halo`` [B, K-1, D] when the caller fetched them.
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

    def forward(self, x, mask=None, cu_seqlens=None, state=None, output_state=False, context_parallel=None,
                halo=None):
        """x: [B, T, D] -> (y [B, T, D], state [N, D, K-1] or None)."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must have shape [B, T, {self.dim}], got {tuple(x.shape)}")
        B, T, D = x.shape
        W = self.kernel_size - 1
        if context_parallel is not None:
            return self._context_parallel(x, context_parallel, halo, mask, cu_seqlens, state, output_state), None
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
        y = short_conv(x, self.weight, hist, cu_seqlens, self.activation)
        return y, (conv_state(x, hist, cu_seqlens, W) if output_state else None)

    def _context_parallel(self, x, cp, halo, mask, cu_seqlens, state, output_state):
        """The convolution of this rank's slice: run on [halo, x] (the K-1 inputs before the slice,
        cut at the sequence starts the layout holds) and keep the last T outputs."""
        if mask is not None or cu_seqlens is not None or state is not None or output_state:
            raise ValueError("with context_parallel the layout comes from it: no mask, cu_seqlens, state or "
                             "output_state")
        W = self.kernel_size - 1
        if halo is None:
            halo = exchange_halo(x, W, cp)
        if tuple(halo.shape) != (x.shape[0], W, x.shape[2]):
            raise ValueError(f"halo must have shape [B, K-1, D] = {[x.shape[0], W, x.shape[2]]}, "
                             f"got {list(halo.shape)}")
        xe = torch.cat([halo.to(x.dtype), x], 1)
        return short_conv(xe, self.weight, None, cp.halo_cu_seqlens(W, x.device), self.activation)[:, W:]

    def extra_repr(self) -> str:
        return f"{self.dim}, kernel_size={self.kernel_size}, activation={self.activation}"


def convolve(convs, xs, mask=None, cu_seqlens=None, states=None, output_state=False):
    """``[conv(x, mask, cu_seqlens, state, output_state) for conv, x, state in zip(convs, xs, states)]``
    (``states`` None: none), as one convolution over all their channels where the op can
    (:func:`gdn.ops.conv.short_conv_group`: the inputs adjacent column blocks of one product, as a
    mixer's q, k and v are, the same kernel size and activation, no mask): one launch each way and
    one autograd node instead of one per convolution."""
    states = (None,) * len(convs) if states is None else tuple(states)
    c0, x0 = convs[0], xs[0]
    W = c0.kernel_size - 1
    same = all(c.kernel_size == c0.kernel_size and c.activation == c0.activation for c in convs)
    fits = all(x.dim() == 3 and x.shape[-1] == c.dim for c, x in zip(convs, xs))
    given = [s is not None for s in states]
    if same and fits and mask is None and (not any(given) or (all(given) and cu_seqlens is None)):
        ok = all(tuple(s.shape) == (x0.shape[0], c.dim, W) for c, s in zip(convs, states) if s is not None)
        hist = torch.cat([s.to(x0.dtype) for s in states], 1) if ok and all(given) else None
        ys = short_conv_group(xs, [c.weight for c in convs], hist, cu_seqlens, c0.activation) if ok else None
        if ys is not None:
            return [(y, conv_state(x, None if s is None else s.to(x.dtype), cu_seqlens, W) if output_state else None)
                    for x, y, s in zip(xs, ys, states)]
    return [c(x, mask=mask, cu_seqlens=cu_seqlens, state=s, output_state=output_state)
            for c, x, s in zip(convs, xs, states)]
