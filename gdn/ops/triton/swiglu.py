"""SwiGLU's elementwise part in one pass each way: ``h = SiLU(gate) · up`` and its backward.

PyTorch runs ``F.silu(gate) * up`` as two kernels forward and the backward's SiLU, products and
``silu_backward`` as five, each a full pass over [tokens, intermediate] tensors; these kernels
read their inputs once and write their outputs once, computing in fp32.

    h = swiglu_forward(gate, up)                  # gate, up: same shape and dtype -> h in that dtype
    dgate, dup = swiglu_backward(dh, gate, up)    # d/dgate = dh·up·σ(g)(1 + g(1 − σ(g))), d/dup = dh·SiLU(g)

gate and up are read in place when their rows are strided views with a contiguous last dim (the
joined product's column blocks in training, the decode step's column slices; :mod:`.rows`);
outputs are packed, or with ``out`` written at gate's and up's strides.

Each program takes a tile of BR rows × BI columns, so a row's start (the layout's divisions) is
formed once per row and its columns are one contiguous run: the loads and stores go out as 16-byte
vectors. The layout's strides are specialised like any integer argument (divisible by 16 or not):
an element-indexed kernel whose offsets come from a division per element, or strides the compiler
cannot see are multiples of 16, issues a 2-byte access per element: about five times the bytes'
time for the backward at the 340m training shapes (docs/BENCHMARKS.md §4).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tuning import OTHER, cdiv
from .rows import row_offsets, rows, strided
from .launch import direct


@triton.jit
def _tile(R, I, BR: tl.constexpr, BI: tl.constexpr):
    """(rows, columns, mask, packed offsets [BR, BI]) of this program's tile of an [R, I] operand."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_c = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (o_r < R)[:, None] & (o_c < I)[None, :]
    return o_r, o_c, m, o_r.to(tl.int64)[:, None] * I + o_c[None, :]


@triton.jit(do_not_specialize=["g_inner", "u_inner"])
def _swiglu_fwd_kernel(g, u, h, R, I, g_inner, g_so, g_si, u_inner, u_so, u_si, STRIDED: tl.constexpr,
                       BR: tl.constexpr, BI: tl.constexpr):
    """h (packed) = SiLU(g) · u over [R, I]; g and u in their row layouts (packed unless STRIDED)."""
    o_r, o_c, m, p = _tile(R, I, BR, BI)
    b_g = tl.load(g + row_offsets(o_r, o_c, p, g_inner, g_so, g_si, STRIDED), mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u + row_offsets(o_r, o_c, p, u_inner, u_so, u_si, STRIDED), mask=m, other=0.0).to(tl.float32)
    b_h = b_g * tl.sigmoid(b_g) * b_u
    tl.store(h + p, b_h.to(h.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["g_inner", "u_inner"])
def _swiglu_bwd_kernel(dh, g, u, dg, du, h, R, I, g_inner, g_so, g_si, u_inner, u_so, u_si, STRIDED: tl.constexpr,
                       OUT_LIKE_IN: tl.constexpr, WANT_H: tl.constexpr, BR: tl.constexpr, BI: tl.constexpr):
    """dg, du from dh (packed), g and u in their row layouts (packed unless STRIDED); dg and du
    packed, or with OUT_LIKE_IN in g's and u's layouts (the columns of one joined gradient). With
    WANT_H also h = SiLU(g) · u (packed), as the forward kernel forms and rounds it: the down
    projection's weight gradient reads it, and it costs one more store here against a pass of its own."""
    o_r, o_c, m, p = _tile(R, I, BR, BI)
    offs_g = row_offsets(o_r, o_c, p, g_inner, g_so, g_si, STRIDED)
    offs_u = row_offsets(o_r, o_c, p, u_inner, u_so, u_si, STRIDED)
    b_dh = tl.load(dh + p, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(g + offs_g, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u + offs_u, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(b_g)
    if OUT_LIKE_IN:
        out_g, out_u = offs_g, offs_u
    else:
        out_g, out_u = p, p
    tl.store(dg + out_g, (b_dh * b_u * sig * (1.0 + b_g * (1.0 - sig))).to(dg.dtype.element_ty), mask=m)
    tl.store(du + out_u, (b_dh * b_g * sig).to(du.dtype.element_ty), mask=m)
    if WANT_H:
        tl.store(h + p, (b_g * sig * b_u).to(h.dtype.element_ty), mask=m)


def _grid(R: int, I: int) -> tuple[tuple[int, int], int, int]:
    """(grid, BR, BI): tiles of BI = the columns' power of two up to OTHER["swiglu"]["BI"] and
    BR = BLOCK / BI rows; row tiles on the grid's first axis (it takes 2³¹ − 1 programs)."""
    c = OTHER["swiglu"]
    BI = min(triton.next_power_of_2(max(I, 1)), c["BI"])
    BR = max(c["BLOCK"] // BI, 1)
    return (cdiv(R, BR), cdiv(I, BI)), BR, BI


def _check(name: str, ref: torch.Tensor, x: torch.Tensor) -> None:
    if x.shape != ref.shape or x.dtype != ref.dtype or x.device != ref.device:
        raise ValueError(f"{name} must match gate in shape, dtype and device ({tuple(ref.shape)}, {ref.dtype}, "
                         f"{ref.device}), got {tuple(x.shape)}, {x.dtype}, {x.device}")


def _operands(gate: torch.Tensor, up: torch.Tensor):
    """(rows of gate, rows of up, I): gate and up as [R, I] rows (:func:`.rows.rows`); a 0-d
    operand is one row of one element."""
    gate, up = (gate.reshape(1) if gate.dim() == 0 else gate), (up.reshape(1) if up.dim() == 0 else up)
    return rows(gate), rows(up), gate.shape[-1]


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up, in gate's dtype (fp32 math), packed. gate, up: any shape, same dtype and device;
    read in place when their rows are strided with a contiguous last dim (:mod:`.rows`)."""
    _check("up", gate, up)
    h = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    n = gate.numel()
    if n:
        rg, ru, I = _operands(gate, up)
        R = n // I
        grid, BR, BI = _grid(R, I)
        direct(_swiglu_fwd_kernel, grid, rg.t, ru.t, h, R, I, *rg.args(), *ru.args(),
               STRIDED=strided(rg, ru), BR=BR, BI=BI, num_warps=OTHER["swiglu"]["num_warps"])
    return h


def swiglu_backward(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None, want_h: bool = False) -> tuple:
    """(dgate, dup) of h = SiLU(gate) · up given dh; all of one shape, dtype and device (gate and up
    read in place as in :func:`swiglu_forward`). Packed, or written into ``out`` = (dgate, dup): views
    with gate's and up's strides (the column blocks of one joined gradient, where gate and up are
    those of one joined product: no copy joins them afterwards). ``want_h``: (dgate, dup, h), h the
    product :func:`swiglu_forward` gives, formed in the same pass."""
    _check("up", gate, up)
    _check("dh", gate, dh)
    if out is None:
        dg = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
        du = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)
    else:
        dg, du = out
        for name, o, ref in (("out[0]", dg, gate), ("out[1]", du, up)):
            _check(name, ref, o)
            if o.stride() != ref.stride():
                raise ValueError(f"{name} must have the strides of its input {ref.stride()}, got {o.stride()}")
    n = gate.numel()
    rg, ru, I = _operands(gate, up) if n else (None, None, 0)
    if n and out is not None and (rg.t is not gate or ru.t is not up):  # a layout rows() copies: not in place
        res = swiglu_backward(dh, rg.t.view(gate.shape), ru.t.view(up.shape), want_h=want_h)
        return (dg.copy_(res[0]), du.copy_(res[1])) + res[2:]
    h = torch.empty(gate.shape, device=gate.device, dtype=gate.dtype) if want_h else None
    if n:
        R = n // I
        grid, BR, BI = _grid(R, I)
        direct(_swiglu_bwd_kernel, grid, dh.contiguous(), rg.t, ru.t, dg, du, h if want_h else dg, R, I, *rg.args(),
               *ru.args(), STRIDED=strided(rg, ru), OUT_LIKE_IN=out is not None, WANT_H=want_h, BR=BR, BI=BI,
               num_warps=OTHER["swiglu"]["num_warps"])
    return (dg, du, h) if want_h else (dg, du)
