"""Column blocks of one product whose gradients are written into one tensor by their consumers.

A mixer's input projections run as one product ``y`` [B, T, N] of their joined weights, and each
projection is a column block of it. Split by ``y.split``, the backward joins the blocks' gradients
with a concatenation: a copy of the whole [B, T, N] gradient, plus zeros for blocks nobody used.
:func:`split_columns` splits ``y`` instead through a Function whose backward owns one [B, T, N]
gradient buffer: a consumer of a block that can write its input gradient at any strides (the
Triton short convolution, the gated RMSNorm) asks its block's :func:`grad_slot` (taken in its forward) for its place of that buffer
during its own backward and writes there; the split's backward then finds those gradients already
in place and copies only the others (small ones: the gate inputs; or any that autograd summed from
several consumers).

Each block is handed out once per backward (a second consumer of the same block gets None and
writes its own gradient, which autograd adds to the first's). A view of a block (``q.view(B, T, H,
K)``) carries its block's tag through :func:`view_block`. Everything else about the blocks is that
of ``y.split``: views of y, the same values; under ``torch.compile`` or with no gradient wanted it
is ``y.split`` itself.
"""
from __future__ import annotations

import torch

from . import library

_TAG = "_gdn_grad_block"


class _Sink:
    """The gradient buffer of one split: allocated by the first block handed out (or by the split's
    backward), released by that backward."""

    def __init__(self, y: torch.Tensor, sizes: list[int]):
        self.shape, self.dtype, self.device = tuple(y.shape), y.dtype, y.device
        self.sizes = sizes
        self.buf: torch.Tensor | None = None
        self.regions: tuple[torch.Tensor, ...] = ()
        self.taken: set[int] = set()

    def region(self, i: int) -> torch.Tensor:
        if self.buf is None:
            self.buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.regions = self.buf.split(self.sizes, -1)  # (one operator for every block's view)
        return self.regions[i]


class _SplitColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, sink: _Sink):
        ctx.sink = sink
        ctx.set_materialize_grads(False)  # a block nobody used gives None: its columns are zeroed
        return y.split(sink.sizes, -1)

    @staticmethod
    def backward(ctx, *grads):
        sink = ctx.sink
        sink.region(0)  # (the buffer, where no consumer asked for it)
        buf, regions = sink.buf, sink.regions
        sink.buf, sink.regions, sink.taken = None, (), set()  # a second backward through this graph starts afresh
        for r, g in zip(regions, grads):
            if g is None:
                r.zero_()
            elif not (g.data_ptr() == r.data_ptr() and g.shape == r.shape and g.stride() == r.stride()):
                r.copy_(g)
        return buf, None


def split_columns(y: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """``y.split(sizes, -1)``, whose backward assembles the blocks' gradients in one buffer that
    consumers write into (:func:`grad_slot`; module docstring). y: [..., sum(sizes)], contiguous
    for the joined path (a product's output is)."""
    if (library.compiling() or not (torch.is_grad_enabled() and y.requires_grad) or not y.is_contiguous()
            or sum(sizes) != y.shape[-1]):
        return y.split(sizes, -1)
    sink = _Sink(y, list(sizes))
    outs = _SplitColumns.apply(y, sink)
    for i, t in enumerate(outs):
        setattr(t, _TAG, (sink, i))
    return outs


def view_block(t: torch.Tensor, *shape) -> torch.Tensor:
    """``t.view(*shape)``, keeping t's block tag (:func:`split_columns`) on the view."""
    v = t.view(*shape)
    tag = getattr(t, _TAG, None)
    if tag is not None:
        setattr(v, _TAG, tag)
    return v


class Slot:
    """A block's place in its split's gradient buffer (:func:`grad_slot`)."""

    __slots__ = ("sink", "i", "shape", "stride", "dtype")

    def __init__(self, sink: _Sink, i: int, t: torch.Tensor):
        self.sink, self.i, self.shape, self.stride, self.dtype = sink, i, tuple(t.shape), t.stride(), t.dtype

    def take(self) -> torch.Tensor | None:
        """The block's place in the buffer, of the tensor's shape, dtype and strides, handed out
        once per backward; None when already handed out or when the buffer's block does not have
        the tensor's strides (a view of a block that is not a view of the buffer's block)."""
        sink = self.sink
        if self.i in sink.taken:
            return None
        try:
            r = sink.region(self.i).view(self.shape)
        except RuntimeError:
            return None
        if r.stride() != self.stride or r.dtype != self.dtype:
            return None
        sink.taken.add(self.i)
        return r


def grad_slot(t: torch.Tensor) -> Slot | None:
    """For a consumer's forward: the slot of ``t`` (a block of :func:`split_columns` or a
    :func:`view_block` of one) whose :meth:`Slot.take`, in the consumer's backward, gives where to
    write t's gradient; None for any other tensor."""
    tag = getattr(t, _TAG, None)
    return None if tag is None else Slot(tag[0], tag[1], t)
