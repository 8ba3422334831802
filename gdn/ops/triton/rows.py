"""Rows of a tensor as the glue kernels address them: packed, or strided in up to two levels.

The glue kernels (RMSNorm, SwiGLU, the L2 norm and the gate of the Gated DeltaNet prologue) work
on ``x [..., D]`` as R rows of D elements. A contiguous x has row r at element ``r·D``. A view
whose last dimension is contiguous but whose rows are not packed is read in place when its leading
dimensions collapse to at most two, ``[R_o, R_i]`` with element strides ``(s_o, s_i)``: row r then
starts at element ``(r // R_i)·s_o + (r % R_i)·s_i``. One level covers a column slice of a wider
product (the decode step's joined projections [B, 1, Σ out] split into [B, 1, out_i]); two levels
cover a per-head view [B, 1, H, K] of such a slice (heads at stride K, rows at the product's
width). Any other layout is copied to a contiguous tensor first.

R_i reaches a kernel as a run-time argument that Triton does not specialise on
(``do_not_specialize``); the strides are specialised as any integer is (divisible by 16 or not), so
that a layout whose rows start on 16 bytes gets vector loads and stores (a kernel that cannot see
that issues one 2-byte access per element in 16 bits), at most a few compiled kernels. A kernel's
constexpr ``STRIDED`` is False when all of its row inputs are contiguous, and that variant
addresses rows as ``r·D`` with no layout arithmetic: contiguous inputs run the code of a kernel
without strides.

    rx = rows(x)                 # rx.t: the tensor to pass (x, or its contiguous copy)
    kernel[grid](rx.t, ..., *rx.args(), ..., STRIDED=strided(rx, ...))

and in the kernel ``row_start(o_r, R_i, s_o, s_i)`` (int64 element offsets of rows ``o_r``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

@dataclass(frozen=True)
class Rows:
    """``t`` [..., D] as rows: row r starts at element ``(r // inner)·s_outer + (r % inner)·s_inner``
    of ``t``; ``strided``: whether that is not ``r·D`` (t is not contiguous)."""

    t: torch.Tensor
    inner: int
    s_outer: int
    s_inner: int
    strided: bool

    def args(self) -> tuple[int, int, int]:
        return self.inner, self.s_outer, self.s_inner


def _levels(shape, strides) -> list[tuple[int, int]] | None:
    """Leading dims (size, stride) with size-1 dims dropped and each dim merged into the one outside
    it when they step as one dim; None when more than two are left."""
    merged: list[tuple[int, int]] = []
    for n, s in zip(shape, strides):
        if n == 1:
            continue
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    return merged if len(merged) <= 2 else None


def rows(x: torch.Tensor) -> Rows:
    """``x`` [..., D] as the rows a glue kernel reads (see the module docstring): x itself when it is
    contiguous, or when its last dim is contiguous (``x.stride(-1) == 1``) and its leading dims
    collapse to two strided levels; otherwise ``x.contiguous()``."""
    D = x.shape[-1]
    R = x.numel() // D if D else 0
    if not x.is_contiguous() and x.numel() and x.stride(-1) == 1:
        levels = _levels(x.shape[:-1], x.stride()[:-1])
        if levels is not None:
            if not levels:  # a single row
                return Rows(x, 1, 0, 0, True)
            if len(levels) == 1:
                return Rows(x, levels[0][0], 0, levels[0][1], True)
            (_, s_o), (n_i, s_i) = levels
            return Rows(x, n_i, s_o, s_i, True)
    return Rows(x.contiguous(), max(R, 1), 0, D, False)


def strided(*rs: Rows | None) -> bool:
    """Whether any of the row inputs of one launch is strided (the kernel's ``STRIDED``)."""
    return any(r is not None and r.strided for r in rs)


@triton.jit
def row_start(o_r, inner, s_outer, s_inner):
    """Element offset (int64) of the start of rows ``o_r`` in a :class:`Rows` layout."""
    o_r = o_r.to(tl.int64)
    return (o_r // inner) * s_outer + (o_r % inner) * s_inner


@triton.jit
def row_offsets(o_r, o_d, packed, inner, s_outer, s_inner, STRIDED: tl.constexpr):
    """Element offsets [BR, BD] of columns ``o_d`` of rows ``o_r`` in a :class:`Rows` layout:
    ``packed`` (the caller's offsets of the packed layout) unless STRIDED."""
    if STRIDED:
        return row_start(o_r, inner, s_outer, s_inner)[:, None] + o_d[None, :]
    return packed
