"""Fused prologue of the Gated DeltaNet layer on the GPU: L2-norm of q and k, the gate and β.

The layer's raw inputs go in once; what the chunk kernels need comes out once::

    q̂ = q · rsqrt(Σ q² + eps),  k̂ likewise                          (per token and head, over K)
    g = −exp(A_log) · softplus(a + dt_bias)                         (fp32)
    β = sigmoid(b)   (2·sigmoid(b) with ``allow_neg_eigval``)        (fp32)

each with its backward (dq, dk through the norm; da, db, dA_log, ddt_bias), as autograd
Functions; :func:`prologue` applies them. :func:`gdn.ops.gated_delta_rule_fused` chains them with
the kernels the router picks.

q, k, a and b are read in place when their rows are strided views with a contiguous last dim (the
decode step's projections are column slices of one product; :mod:`gdn.ops.triton.rows`); the
outputs are packed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...gates import L2NORM_EPS
from ...tuning import OTHER, cdiv, pow2
from ...triton.rows import row_offsets, row_start, rows, strided
from ...triton.colsum import colsum
from ...triton.launch import direct


@triton.jit(do_not_specialize=["inner"])
def l2norm_fwd_kernel(x, y, r, n_rows, inner, s_outer, s_inner, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                      eps, STRIDED: tl.constexpr):
    """y = x · rsqrt(Σx² + eps) over the last dim; r = that rsqrt (fp32), for BR rows. x in its row
    layout (packed unless STRIDED); y packed."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < n_rows)[:, None] & (o_d < D)[None, :]
    p = o_r[:, None].to(tl.int64) * D + o_d[None, :]
    p_x = row_offsets(o_r, o_d, p, inner, s_outer, s_inner, STRIDED)
    b_x = tl.load(x + p_x, mask=m, other=0.0).to(tl.float32)
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + eps)
    tl.store(y + p, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(r + o_r, b_r, mask=o_r < n_rows)


@triton.jit(do_not_specialize=["inner"])
def l2norm_bwd_kernel(x, r, dy, dx, n_rows, inner, s_outer, s_inner, D: tl.constexpr, BD: tl.constexpr,
                      BR: tl.constexpr, STRIDED: tl.constexpr):
    """dx = r (dy − ŷ (ŷ·dy)) with ŷ = x r (exact with eps: dr/dx = −r³ x). x in its row layout
    (packed unless STRIDED); dy, dx packed."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < n_rows)[:, None] & (o_d < D)[None, :]
    p = o_r[:, None].to(tl.int64) * D + o_d[None, :]
    p_x = row_offsets(o_r, o_d, p, inner, s_outer, s_inner, STRIDED)
    b_r = tl.load(r + o_r, mask=o_r < n_rows, other=0.0)
    b_y = tl.load(x + p_x, mask=m, other=0.0).to(tl.float32) * b_r[:, None]
    b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
    b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_y * b_dy, axis=1)[:, None])
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)


@triton.jit
def _gate_offsets(o, h, HV, inner, s_outer, s_inner, STRIDED: tl.constexpr):
    """Element offsets of the flat indices ``o`` (head ``h = o % HV``) of a [R, HV] operand in its row
    layout (``o`` itself unless STRIDED)."""
    if STRIDED:
        p = row_start(o // HV, inner, s_outer, s_inner) + h
    else:
        p = o
    return p


@triton.jit(do_not_specialize=["a_inner", "b_inner"])
def gate_fwd_kernel(a, b, A_log, dt_bias, g, beta, n, HV, a_inner, a_so, a_si, b_inner, b_so, b_si,
                    BLOCK: tl.constexpr, NEG: tl.constexpr, STRIDED: tl.constexpr):
    """g = −exp(A_log[h]) softplus(a + dt_bias[h]); β = (1 or 2)·sigmoid(b); h = index mod HV. a and
    b in their row layouts (packed unless STRIDED); g, β packed."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    h = o % HV
    p_a = _gate_offsets(o, h, HV, a_inner, a_so, a_si, STRIDED)
    p_b = _gate_offsets(o, h, HV, b_inner, b_so, b_si, STRIDED)
    b_x = tl.load(a + p_a, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias + h, mask=m, other=0.0).to(tl.float32)
    sp = tl.where(b_x > 20.0, b_x, tl.log(1.0 + tl.exp(tl.minimum(b_x, 20.0))))
    b_g = -tl.exp(tl.load(A_log + h, mask=m, other=0.0).to(tl.float32)) * sp
    b_s = tl.sigmoid(tl.load(b + p_b, mask=m, other=0.0).to(tl.float32))
    if NEG:
        b_s = 2.0 * b_s
    tl.store(g + o, b_g, mask=m)
    tl.store(beta + o, b_s, mask=m)


@triton.jit(do_not_specialize=["a_inner", "b_inner"])
def gate_bwd_kernel(a, b, A_log, dt_bias, g, dg, dbeta, da, db, dgg, n, HV, a_inner, a_so, a_si, b_inner, b_so, b_si,
                    BLOCK: tl.constexpr, NEG: tl.constexpr, STRIDED: tl.constexpr):
    """da = dg·(−exp(A_log))·sigmoid(a + dt_bias); db = dβ·c·σ(b)(1 − σ(b)); dgg = dg·g (→ dA_log).
    a and b in their row layouts (packed unless STRIDED); everything else packed."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    h = o % HV
    p_a = _gate_offsets(o, h, HV, a_inner, a_so, a_si, STRIDED)
    p_b = _gate_offsets(o, h, HV, b_inner, b_so, b_si, STRIDED)
    b_x = tl.load(a + p_a, mask=m, other=0.0).to(tl.float32) + tl.load(dt_bias + h, mask=m, other=0.0).to(tl.float32)
    b_dg = tl.load(dg + o, mask=m, other=0.0).to(tl.float32)
    b_da = -b_dg * tl.exp(tl.load(A_log + h, mask=m, other=0.0).to(tl.float32)) * tl.sigmoid(b_x)
    b_sb = tl.sigmoid(tl.load(b + p_b, mask=m, other=0.0).to(tl.float32))
    b_db = tl.load(dbeta + o, mask=m, other=0.0).to(tl.float32) * b_sb * (1.0 - b_sb)
    if NEG:
        b_db = 2.0 * b_db
    tl.store(da + o, b_da.to(da.dtype.element_ty), mask=m)
    tl.store(db + o, b_db.to(db.dtype.element_ty), mask=m)
    tl.store(dgg + o, b_dg * tl.load(g + o, mask=m, other=0.0), mask=m)


def _l2_forward(x, eps: float):
    """(x̂ packed in x.dtype, x as the kernel read it, rstd [rows] fp32) of :class:`L2Norm`."""
    D = x.shape[-1]
    rx = rows(x)
    n = x.numel() // D
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    r = torch.empty(n, device=x.device, dtype=torch.float32)
    c = OTHER["l2norm"]
    if n:
        direct(l2norm_fwd_kernel, (cdiv(n, c["BR"]),), rx.t, y, r, n, *rx.args(), D=D, BD=pow2(D, 1), BR=c["BR"],
               eps=eps, STRIDED=rx.strided, num_warps=c["num_warps"])
    return y, rx.t, r


def _l2_backward(xs, r, dy):
    """dx (packed) of :class:`L2Norm` from what :func:`_l2_forward` saved."""
    D = xs.shape[-1]
    n = xs.numel() // D
    rx = rows(xs)
    dx = torch.empty(xs.shape, device=xs.device, dtype=xs.dtype)
    c = OTHER["l2norm"]
    if n:
        direct(l2norm_bwd_kernel, (cdiv(n, c["BR"]),), rx.t, r, dy.contiguous(), dx, n, *rx.args(), D=D,
               BD=pow2(D, 1), BR=c["BR"], STRIDED=rx.strided, num_warps=c["num_warps"])
    return dx


def _gate_forward(a, b, A_log, dt_bias, neg: bool):
    """(g, β, a and b as the kernel read them) of :class:`Gate`."""
    ra, rb = rows(a), rows(b)
    HV = a.shape[-1]
    n = a.numel()
    g = torch.empty(a.shape, device=a.device, dtype=torch.float32)
    beta = torch.empty(a.shape, device=a.device, dtype=torch.float32)
    c = OTHER["gate"]
    if n:
        direct(gate_fwd_kernel, (cdiv(n, c["BLOCK"]),), ra.t, rb.t, A_log.contiguous(), dt_bias.contiguous(), g,
               beta, n, HV, *ra.args(), *rb.args(), BLOCK=c["BLOCK"],
               NEG=neg, STRIDED=strided(ra, rb), num_warps=c["num_warps"])
    return g, beta, ra.t, rb.t


def _gate_backward(a, b, A_log, dt_bias, g, dg, dbeta, neg: bool):
    """(da, db, dA_log, d dt_bias) of :class:`Gate` (None for a gradient that did not flow)."""
    ra, rb = rows(a), rows(b)
    HV = a.shape[-1]
    n = a.numel()
    dg = torch.zeros_like(g) if dg is None else dg.contiguous()
    dbeta = torch.zeros_like(g) if dbeta is None else dbeta.contiguous()
    da = torch.empty(a.shape, device=a.device, dtype=a.dtype)
    db = torch.empty(b.shape, device=b.device, dtype=b.dtype)
    dgg = torch.empty_like(g)
    c = OTHER["gate"]
    if n:
        direct(gate_bwd_kernel, (cdiv(n, c["BLOCK"]),), ra.t, rb.t, A_log.contiguous(), dt_bias.contiguous(), g,
               dg, dbeta, da, db, dgg, n, HV, *ra.args(), *rb.args(),
               BLOCK=c["BLOCK"], NEG=neg, STRIDED=strided(ra, rb), num_warps=c["num_warps"])
    # d dt_bias = Σ da over tokens; d A_log = Σ dg · g (g is linear in exp(A_log)).
    dA_log = colsum(dgg.view(-1, HV)).to(A_log.dtype)
    ddt = colsum(da.view(-1, HV)).to(dt_bias.dtype)  # (summed in fp32, no fp32 copy of da)
    return da, db, dA_log, ddt


class L2Norm(torch.autograd.Function):
    """x̂ = x · rsqrt(Σ x² + eps) over the last dim, in x.dtype (computed in fp32), packed. x: [..., D],
    read in place when its rows are strided with a contiguous last dim (:mod:`gdn.ops.triton.rows`)."""

    @staticmethod
    def forward(ctx, x, eps: float):
        y, xs, r = _l2_forward(x, eps)
        ctx.save_for_backward(xs, r)
        return y

    @staticmethod
    def backward(ctx, dy):
        xs, r = ctx.saved_tensors
        return _l2_backward(xs, r, dy), None


class Gate(torch.autograd.Function):
    """(g, β) from the raw a, b [B, T, HV] and the per-head A_log, dt_bias [HV]; both fp32, packed. a
    and b are read in place when their rows are strided with a contiguous last dim
    (:mod:`gdn.ops.triton.rows`)."""

    @staticmethod
    def forward(ctx, a, b, A_log, dt_bias, neg: bool):
        g, beta, at, bt = _gate_forward(a, b, A_log, dt_bias, neg)
        ctx.save_for_backward(at, bt, A_log, dt_bias, g)
        ctx.neg = neg
        return g, beta

    @staticmethod
    def backward(ctx, dg, dbeta):
        a, b, A_log, dt_bias, g = ctx.saved_tensors
        return *_gate_backward(a, b, A_log, dt_bias, g, dg, dbeta, ctx.neg), None


class Prologue(torch.autograd.Function):
    """:class:`Gate` and the :class:`L2Norm` of q and of k as one autograd node: the same launches
    and gradients, one Function's host work in each direction instead of three (an autograd
    Function's forward and backward cost a GPU machine's host ≈ 100 µs, the step of a model pays it
    per layer)."""

    @staticmethod
    def forward(ctx, q, k, a, b, A_log, dt_bias, eps: float, neg: bool):
        g, beta, at, bt = _gate_forward(a, b, A_log, dt_bias, neg)
        qn, qs, rq = _l2_forward(q, eps)
        kn, ks, rk = _l2_forward(k, eps)
        ctx.save_for_backward(qs, rq, ks, rk, at, bt, A_log, dt_bias, g)
        ctx.neg = neg
        return qn, kn, g, beta

    @staticmethod
    def backward(ctx, dq, dk, dg, dbeta):
        qs, rq, ks, rk, a, b, A_log, dt_bias, g = ctx.saved_tensors
        dq = _l2_backward(qs, rq, dq) if dq is not None and ctx.needs_input_grad[0] else None
        dk = _l2_backward(ks, rk, dk) if dk is not None and ctx.needs_input_grad[1] else None
        return dq, dk, *_gate_backward(a, b, A_log, dt_bias, g, dg, dbeta, ctx.neg), None, None


def prologue(q, k, a, b, A_log, dt_bias, use_qk_l2norm: bool, allow_neg_eigval: bool):
    """(q̂, k̂, g, β) from the layer's raw inputs on the GPU, differentiable.

    q, k: [B, T, H, K]; a, b: [B, T, HV]; A_log, dt_bias: [HV]. q̂, k̂ in q's and k's dtype
    (normalised only with ``use_qk_l2norm``); g, β: [B, T, HV] fp32."""
    if use_qk_l2norm:
        return Prologue.apply(q, k, a, b, A_log, dt_bias, L2NORM_EPS, bool(allow_neg_eigval))
    g, beta = Gate.apply(a, b, A_log, dt_bias, bool(allow_neg_eigval))
    return q, k, g, beta
