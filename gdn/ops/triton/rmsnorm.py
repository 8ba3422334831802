"""RMSNorm and output-gated RMSNorm, one Triton pass each way (fp32 math).

    y = x · rstd · w                 (rms_norm)         rstd = rsqrt(mean(x²) + eps) over the last dim
    y = x · rstd · w · SiLU(gate)    (gated_rms_norm)

PyTorch runs each as a chain of ~7 elementwise and reduction kernels per direction; here one
program normalises a block of rows in registers. Like the PyTorch Functions of
:mod:`gdn.ops.norm`, the autograd Functions save x (and the gate) in their own dtype and rstd
[rows] in fp32, and the backward recomputes the normalised rows:

    xhat = x · rstd;   dn = dy (· SiLU(gate));   dxhat = dn · w
    dx = rstd · (dxhat − xhat · mean(dxhat · xhat));   dw = Σ_rows dn · xhat
    dgate = dy · xhat · w · σ(g)(1 + g(1 − σ(g)))

dw is reduced per program (each covers a run of row blocks) into fp32 partials [programs, D],
summed in torch.

x and the gate are read in place when their rows are strided views with a contiguous last dim (a
column slice of a wider product, per head or not; :mod:`.rows`), so the decode step's joined
projections feed the norm without a copy; y, dx and dgate are written packed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tuning import INTERPRET, OTHER, cdiv, norm_tiles, pow2
from ..joined import grad_slot
from .rows import row_offsets, rows, strided
from .colsum import colsum
from .launch import direct

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["x_inner", "g_inner"])
def _norm_fwd_kernel(x, g, w, y, rstd, R, D, eps, x_inner, x_so, x_si, g_inner, g_so, g_si, GATED: tl.constexpr,
                     STRIDED: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """x and the gate in their row layouts (:mod:`.rows`; packed unless STRIDED); y packed [R, D]."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r, m_d = o_r < R, o_d < D
    m = m_r[:, None] & m_d[None, :]
    offs = o_r[:, None] * D + o_d[None, :]
    offs_x = row_offsets(o_r, o_d, offs, x_inner, x_so, x_si, STRIDED)
    offs_g = row_offsets(o_r, o_d, offs, g_inner, g_so, g_si, STRIDED)
    b_x = tl.load(x + offs_x, mask=m, other=0.0).to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = b_x * b_rstd[:, None] * b_w[None, :]
    if GATED:
        b_g = tl.load(g + offs_g, mask=m, other=0.0).to(tl.float32)
        b_y = b_y * b_g * tl.sigmoid(b_g)
    tl.store(y + offs, b_y.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_rstd, mask=m_r)


@triton.jit
def _bwd_block(x, g, rstd, dy, ds, blk, R, D, o_d, m_d, x_inner, x_so, x_si, g_inner, g_so, g_si,
               GATED: tl.constexpr, STRIDED: tl.constexpr, BR: tl.constexpr, DS: tl.constexpr, live=True):
    """Block ``blk``'s rows as the backward reads them, as loaded (``live`` False: nothing read):
    (offsets of the packed layout, of x's, of the gate's, the mask, rstd, x, dy, gate, ds), the
    gate and ds where GATED and DS (else dy again)."""
    o_r = blk.to(tl.int64) * BR + tl.arange(0, BR)
    m_r = (o_r < R) & live
    m = m_r[:, None] & m_d[None, :]
    offs = o_r[:, None] * D + o_d[None, :]
    offs_x = row_offsets(o_r, o_d, offs, x_inner, x_so, x_si, STRIDED)
    offs_g = row_offsets(o_r, o_d, offs, g_inner, g_so, g_si, STRIDED)
    b_rstd = tl.load(rstd + o_r, mask=m_r, other=0.0)
    b_x = tl.load(x + offs_x, mask=m, other=0.0)
    b_dy = tl.load(dy + offs, mask=m, other=0.0)
    b_g = tl.load(g + offs_g, mask=m, other=0.0) if GATED else b_dy
    b_ds = tl.load(ds + offs, mask=m, other=0.0) if DS else b_dy
    return offs, offs_g, m, b_rstd, b_x, b_dy, b_g, b_ds


@triton.jit(do_not_specialize=["x_inner", "g_inner"])
def _norm_bwd_kernel(x, g, w, rstd, dy, dx, dg, dwp, ds, dh, R, D, x_inner, x_so, x_si, g_inner, g_so, g_si,
                     GATED: tl.constexpr, STRIDED: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
                     NLOOP: tl.constexpr, RES: tl.constexpr = False, DS: tl.constexpr = False,
                     DG_AT_G: tl.constexpr = False):
    """One program: NLOOP blocks of BR rows; writes dx (and dgate) and its dw partial [D]. x and the
    gate in their row layouts (:mod:`.rows`; packed unless STRIDED); dy, dx, dgate packed [R, D].
    ``RES`` (the norm of a residual sum s = x + h, x here being s): dx is the whole gradient of s,
    the norm's plus ``ds`` (the stream's own, where ``DS``), written as dx in its dtype and again as
    dh in h's (both packed [R, D]). ``DG_AT_G``: dgate written at the gate's own layout (its block
    of a joined gradient, :mod:`gdn.ops.joined`) instead of packed. The next block's rows are
    requested before this block's stores: a load cannot pass an earlier store the compiler cannot
    tell apart from it, so loaded where used each block's loads would wait for the block before's
    stores (on an H100 at the gated norm of [98304, 256]: 109 µs against 127)."""
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BD], dtype=tl.float32)
    nxt = _bwd_block(x, g, rstd, dy, ds, i_p * NLOOP, R, D, o_d, m_d, x_inner, x_so, x_si, g_inner, g_so, g_si,
                     GATED, STRIDED, BR, DS)
    for l in range(NLOOP):
        offs, offs_g, m, b_rstd, b_x, dn, b_g, b_ds = nxt
        nxt = _bwd_block(x, g, rstd, dy, ds, i_p * NLOOP + l + 1, R, D, o_d, m_d, x_inner, x_so, x_si, g_inner,
                         g_so, g_si, GATED, STRIDED, BR, DS, l + 1 < NLOOP)
        xhat = b_x.to(tl.float32) * b_rstd[:, None]
        dn = dn.to(tl.float32)
        if GATED:
            b_g = b_g.to(tl.float32)
            sig = tl.sigmoid(b_g)
            b_dg = dn * xhat * b_w[None, :] * sig * (1.0 + b_g * (1.0 - sig))
            tl.store(dg + (offs_g if DG_AT_G else offs), b_dg.to(dg.dtype.element_ty), mask=m)
            dn = dn * b_g * sig
        b_dw += tl.sum(dn * xhat, 0)
        dxhat = dn * b_w[None, :]
        c = tl.sum(dxhat * xhat, 1) / D
        b_dx = b_rstd[:, None] * (dxhat - xhat * c[:, None])
        if DS:
            b_dx += b_ds.to(tl.float32)
        tl.store(dx + offs, b_dx.to(dx.dtype.element_ty), mask=m)
        if RES:
            tl.store(dh + offs, b_dx.to(dh.dtype.element_ty), mask=m)
    tl.store(dwp + i_p.to(tl.int64) * D + o_d, b_dw, mask=m_d)


@triton.jit
def _add_norm_fwd_kernel(x, h, w, s, y, rstd, R, D, eps, BR: tl.constexpr, BD: tl.constexpr):
    """s = x + h rounded to s's dtype (the residual stream); y = s · rstd · w from that rounded s,
    the arithmetic of :func:`_norm_fwd_kernel` on it, and rstd [R] (for the backward). All packed
    [R, D]."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m = (o_r < R)[:, None] & m_d[None, :]
    offs = o_r[:, None] * D + o_d[None, :]
    b_s = tl.load(x + offs, mask=m, other=0.0).to(tl.float32) + tl.load(h + offs, mask=m, other=0.0).to(tl.float32)
    b_s = b_s.to(s.dtype.element_ty)
    tl.store(s + offs, b_s, mask=m)
    b_x = b_s.to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(y + offs, (b_x * b_rstd[:, None] * b_w[None, :]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_rstd, mask=o_r < R)


def _rows(x, g):
    """The row layouts of x and the gate (None without one), copies made only for layouts the
    kernels do not read (:func:`.rows.rows`)."""
    return rows(x), (rows(g) if g is not None else None)


def _forward(x, g, weight, eps, out_dtype):
    """(y [..., D] packed in ``out_dtype``, rstd [R] fp32, x and g as the kernel read them) for x
    [..., D] (gate ``g`` of x's shape or None) in any layout: what :func:`.rows.rows` does not take
    is copied, and the tensors returned are the ones to save for :func:`_backward`."""
    D = x.shape[-1]
    R = x.numel() // D if D else 0
    y = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    rstd = torch.empty(R, device=x.device, dtype=torch.float32)
    if not R:
        return y, rstd, x, g
    rx, rg = _rows(x, g)
    gl = rg if rg is not None else rx
    BR, BD, nw = norm_tiles(D)
    direct(_norm_fwd_kernel, (cdiv(R, BR),), rx.t, gl.t, weight, y, rstd, R, D, eps, *rx.args(), *gl.args(),
           GATED=g is not None, STRIDED=strided(rx, rg), BR=BR, BD=BD, num_warps=nw)
    return y, rstd, rx.t, (rg.t if rg is not None else None)


def _backward(dy, x, g, weight, rstd, ds=None, h_dtype=None, dg=None):
    """(dx, dgate or None, both packed with x's shape, dw in fp32) for x [..., D] (and the gate) in
    any layout :func:`.rows.rows` takes; dy of x's shape. With ``h_dtype`` (the norm of a residual
    sum x = s + h, no gate): (dx, dh, dw), dx and dh the whole gradient of the sum (the norm's plus
    ``ds``, the stream's own gradient, when given) in x's dtype and in ``h_dtype``. ``dg``: where to
    write dgate, a tensor with the gate's strides (the gate read in place), instead of a packed one."""
    D = x.shape[-1]
    R = x.numel() // D if D else 0
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    dg_at_g = dg is not None
    if g is not None and dg is None:
        dg = torch.empty(g.shape, device=g.device, dtype=g.dtype)
    dh = torch.empty(x.shape, device=x.device, dtype=h_dtype) if h_dtype is not None else None
    if not R:
        return dx, (dh if dh is not None else dg), torch.zeros(D, device=x.device, dtype=torch.float32)
    rx, rg = _rows(x, g)
    gl = rg if rg is not None else rx
    dy = dy.contiguous()
    BR, BD, nw = norm_tiles(D)
    nblocks = cdiv(R, BR)
    target = 4 if INTERPRET else OTHER["rmsnorm"]["programs"]  # programs wanted: a few per SM on the GPU
    nloop = min(64, pow2(cdiv(nblocks, target), 1))
    nprog = cdiv(nblocks, nloop)
    dwp = torch.empty(nprog, D, device=x.device, dtype=torch.float32)
    if ds is not None:
        ds = ds.contiguous()
    direct(_norm_bwd_kernel, (nprog,), rx.t, gl.t, weight, rstd, dy, dx, dg if dg is not None else dx, dwp,
           ds if ds is not None else dx, dh if dh is not None else dx, R, D, *rx.args(), *gl.args(), GATED=g is not None,
           STRIDED=strided(rx, rg), BR=BR, BD=BD, NLOOP=nloop, RES=dh is not None, DS=ds is not None,
           DG_AT_G=dg_at_g, num_warps=nw)
    return dx, (dh if dh is not None else dg), colsum(dwp)


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype: torch.dtype):
        y, rstd, xs, _ = _forward(x, None, weight.contiguous(), eps, out_dtype)
        ctx.save_for_backward(xs, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, _, dw = _backward(dy, x, None, weight.contiguous(), rstd)
        return dx, dw.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None


class _GatedRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps: float):
        y, rstd, xs, gs = _forward(x, gate, weight.contiguous(), eps, x.dtype)
        # the gate a block of a joined product, read in place: dgate goes into its joined gradient
        ctx.slot = grad_slot(gate) if gs is gate else None
        ctx.save_for_backward(xs, gs, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        target = ctx.slot.take() if ctx.slot is not None and ctx.needs_input_grad[1] else None
        dx, dg, dw = _backward(dy, x, gate, weight.contiguous(), rstd, dg=target)
        return dx, dg, dw.to(weight.dtype) if ctx.needs_input_grad[2] else None, None


class _AddRMSNormFn(torch.autograd.Function):
    """``(s, y)`` of :func:`add_rms_norm` with gradients: one kernel each way. The backward's kernel
    adds the stream's gradient ds to the norm's and writes the sum as both x's and h's gradient, so
    no separate accumulation or cast of the residual's gradient runs. Saves s (the stream, kept by
    its next reader anyway), the weight and rstd."""

    @staticmethod
    def forward(ctx, x, h, weight, eps: float, out_dtype: torch.dtype):
        s, y, rstd = _add_forward(x, h, weight.contiguous(), eps, out_dtype)
        ctx.save_for_backward(s, weight, rstd)
        ctx.h_dtype = h.dtype
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight, rstd = ctx.saved_tensors
        if dy is None:  # only the stream is used: the norm adds nothing
            return ds, ds.to(ctx.h_dtype), None, None, None
        dx, dh, dw = _backward(dy, s, None, weight.contiguous(), rstd, ds, ctx.h_dtype)
        return dx, dh, dw.to(weight.dtype) if ctx.needs_input_grad[2] else None, None, None


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if x.dim() == 0 or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x must have shape [..., D] with weight [D], got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x · rstd · weight`` in fp32, returned in ``out_dtype`` (x's dtype when None); differentiable.

    x: [..., D] fp16 / bf16 / fp32; weight: [D]. Returns [..., D]."""
    _check(x, weight)
    return _RMSNormFn.apply(x, weight, float(eps), out_dtype or x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x · rstd · weight · SiLU(gate)`` in fp32, returned in x's dtype; differentiable.

    x, gate: [..., D] (same shape); weight: [D]. Returns [..., D]."""
    _check(x, weight)
    if gate.shape != x.shape:
        raise ValueError(f"gate must have the shape of x {tuple(x.shape)}, got {tuple(gate.shape)}")
    return _GatedRMSNormFn.apply(x, gate, weight, float(eps))


def _add_forward(x, h, weight, eps, out_dtype):
    """(s = x + h in x's dtype, y in ``out_dtype``, rstd [R] fp32), x and h packed."""
    x, h = x.contiguous(), h.contiguous()
    D = x.shape[-1]
    R = x.numel() // D
    s = torch.empty_like(x)
    y = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    rstd = torch.empty(R, device=x.device, dtype=torch.float32)
    if R:
        BR, BD, nw = norm_tiles(D)
        direct(_add_norm_fwd_kernel, (cdiv(R, BR),), x, h, weight, s, y, rstd, R, D, float(eps), BR=BR, BD=BD,
               num_warps=nw)
    return s, y, rstd


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, y)``: the residual add ``s = x + h`` (in x's dtype, as PyTorch rounds it) and
    ``y = s · rstd · weight`` (:func:`rms_norm` of that s, in ``out_dtype``, x's dtype when None), in
    one launch each way; differentiable in x, h and weight. x, h: [..., D] of one shape (copied when
    not contiguous), h in x's dtype or one that x's holds (bf16 or fp16 into fp32: the training
    step's residual stream); weight: [D]."""
    _check(x, weight)
    if h.shape != x.shape or torch.promote_types(x.dtype, h.dtype) != x.dtype:
        raise ValueError(f"h must have the shape of x {tuple(x.shape)} and a dtype that x's {x.dtype} holds, got "
                         f"{tuple(h.shape)}, {h.dtype}")
    if torch.is_grad_enabled() and (x.requires_grad or h.requires_grad or weight.requires_grad):
        return _AddRMSNormFn.apply(x, h, weight, float(eps), out_dtype or x.dtype)
    # no autograd node where no gradient will flow (the decode step): its host time is per layer and token
    return _add_forward(x, h, weight.contiguous(), eps, out_dtype or x.dtype)[:2]
