"""Weights of several layers concatenated, so that one kernel serves them all (the decode step).

A decode step multiplies a few rows by every projection of a layer; each product is one small GEMM
whose cost is its launch, not its arithmetic. :class:`FusedLinear` holds the layers' weights
concatenated along the output dimension, so one GEMM computes them all, and hands back each output as
a view of that product; every output element is the same dot product as in the separate layer.
:class:`FusedWeight` is the concatenation alone (the three short convolutions' weights, run as one
depthwise convolution over their channels).

The concatenated weight is a copy. It is built once and keeps its storage (a captured CUDA graph
reads it by address); :meth:`FusedWeight.refresh` copies the layers' weights into it again when one
of them was written since (PyTorch counts every in-place write of a tensor in its version counter:
``load_state_dict``, optimiser steps, ``torch.nn.init``) or now lives elsewhere. A write through
``param.data`` is not counted and is not seen.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.gemv import decode_linear


class FusedWeight:
    """The ``weight`` of each of ``modules`` (a dict name -> module; the weights differ only in their
    first dimension and share dtype and device) concatenated along dim 0.

    ``weight``: [Σ size_i, ...], no gradient; ``sizes``: each module's share of dim 0, in order.
    """

    def __init__(self, modules: dict[str, nn.Module]):
        self.names = tuple(modules)
        self.modules = tuple(modules.values())
        if not self.modules:
            raise ValueError(f"{type(self).__name__} needs at least one module")
        self.sizes = [m.weight.shape[0] for m in self.modules]
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in self.modules])
        self._key = self._source_key()

    def _source_key(self) -> tuple:
        return tuple((m.weight.data_ptr(), m.weight._version) for m in self.modules)

    def refresh(self) -> bool:
        """Copy the modules' weights in again, in place, if one was written or moved since the last
        copy. Returns whether it copied."""
        key = self._source_key()
        if key == self._key:
            return False
        with torch.no_grad():
            torch.cat([m.weight for m in self.modules], out=self.weight)
        self._key = key
        return True

    def split(self, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """``y`` [..., Σ size_i] as a dict name -> its module's part [..., size_i] (views)."""
        return dict(zip(self.names, y.split(self.sizes, -1)))


class FusedLinear(FusedWeight):
    """Bias-free ``nn.Linear`` layers of one input as one weight [Σ out_i, in].

    ``fused(x)``: x [..., in] -> a dict name -> that layer's output [..., out_i], each a view of one
    product [..., Σ out_i] (in the dict's order).
    """

    def __init__(self, linears: dict[str, nn.Linear]):
        for lin in linears.values():
            if not isinstance(lin, nn.Linear) or lin.bias is not None:
                raise ValueError(f"FusedLinear takes bias-free nn.Linear layers, got {lin!r}")
        super().__init__(linears)

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.split(decode_linear(x, self.weight))


def refresh_all(parts) -> None:
    """:meth:`FusedWeight.refresh` every one of ``parts`` (nested tuples and lists of them; None skipped)."""
    if isinstance(parts, FusedWeight):
        parts.refresh()
    elif isinstance(parts, (tuple, list)):
        for p in parts:
            refresh_all(p)


def joinable(mods) -> bool:
    """Whether ``mods`` can run as one product of their joined weights with the same result: plain
    bias-free ``nn.Linear`` layers (a subclass or a wrapper may change what the layer computes),
    with no forward hook of their own or of every module (a hook may read or change the output)."""
    from torch.nn.modules import module as module_mod  # noqa: PLC0415

    if module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks:
        return False
    return all(type(m) is nn.Linear and m.bias is None and not m._forward_hooks and not m._forward_pre_hooks
               for m in mods)


class _JoinedWeight(torch.autograd.Function):
    """The weights stacked by rows, then ``pad`` zero rows, in ``dtype``: one kernel (a concatenation
    into a tensor of that dtype) for what ``torch.cat`` then autocast's cast would do in two, each
    reading and writing the whole. The backward casts the joined gradient to the weights' dtype
    once and hands each weight its rows (views), as the cast's and the concatenation's backwards
    would."""

    @staticmethod
    def forward(ctx, dtype, pad: int, *ws):
        parts = _with_pad(ws, pad)
        out = torch.empty(sum(p.shape[0] for p in parts), *ws[0].shape[1:], device=ws[0].device, dtype=dtype)
        torch.cat(parts, out=out)
        ctx.rows = [w.shape[0] for w in ws]
        ctx.wdtype = ws[0].dtype
        return out

    @staticmethod
    def backward(ctx, g):
        rows = ctx.rows
        return (None, None, *g[:sum(rows)].to(ctx.wdtype).split(rows))


def joined_weight(ws, dtype: torch.dtype | None = None, pad: int = 0) -> torch.Tensor:
    """The weights ``ws`` (same trailing shape, dtype and device) stacked along dim 0, then ``pad``
    zero rows, as the weight of one product of their layers. ``dtype``: the autocast dtype the
    product will run in (None: autocast is off); an fp32 join is then cast to it in the same pass,
    so that autocast finds the weight already in its dtype and casts nothing. The gradients reach
    each weight as through ``torch.cat`` and the cast."""
    ws = list(ws)
    if dtype is None or dtype == ws[0].dtype or ws[0].dtype != torch.float32 or torch.compiler.is_compiling():
        return torch.cat(_with_pad(ws, pad))
    return _JoinedWeight.apply(dtype, pad, *ws)


def _with_pad(ws, pad: int) -> list:
    """``ws`` and, where ``pad``, a block of ``pad`` zero rows after them."""
    return list(ws) + ([ws[0].new_zeros(pad, *ws[0].shape[1:])] if pad else [])
