"""The decode step's products of a few rows by a weight: ``y = x Wᵀ`` for x [M, K] with M ≤ 4.

At one row a projection reads its whole weight to do 2·N·K FLOPs: it is a pass over the weight,
and its time is the weight's bytes over the bandwidth the kernel reaches. cuBLAS's kernels for
these shapes reach 0.6–1.2 TB/s on the H200 (a 340m layer's four products took 29 µs per token for
30 MB of weights). This kernel streams the weight instead: each program owns BN output columns
(BN rows of W), walks K in tiles of BK holding a [BN, BK] tile of W, and multiplies it by each of the
M rows of x; BN is chosen so that the programs number about twice the multiprocessors (a short N,
e.g. an output projection to 1024, still spreads over the card) and BK so that a tile stays at
4096 elements (32 per thread, loaded as wide vectors). Accumulation is fp32; y is stored in x's
dtype.

``GLU``: x is SwiGLU's gate and ``u`` its up operand: the kernel multiplies by h = SiLU(gate) · up,
formed per tile in fp32 and rounded to the input dtype as :mod:`.swiglu`'s forward rounds h, so the
MLP's down projection needs no separate elementwise pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tuning import OTHER, cdiv, pow2
from .launch import direct, sm_count


@triton.jit
def _row_tile(x, u, wn, m, o_k, m_x, sx, su, r_m, FORM: tl.constexpr, HAS_U: tl.constexpr):
    """Row m's K tile ``o_k`` of the product's input, in x's dtype: x itself (FORM 0); SiLU(x) · u
    (FORM 1, SwiGLU); or RMSNorm(s) · wn with s = x (+ u when HAS_U) rounded to x's dtype and
    ``r_m`` its row's 1 / rms (FORM 2). Returns (input tile, s tile)."""
    b_x = tl.load(x + m * sx + o_k, mask=m_x, other=0.0)
    b_s = b_x
    if FORM == 1:
        b_g = b_x.to(tl.float32)
        b_u = tl.load(u + m * su + o_k, mask=m_x, other=0.0).to(tl.float32)
        b_x = (b_g * tl.sigmoid(b_g) * b_u).to(x.dtype.element_ty)
    if FORM == 2:
        if HAS_U:
            b_s = (b_x.to(tl.float32) + tl.load(u + m * su + o_k, mask=m_x, other=0.0).to(tl.float32))
            b_s = b_s.to(x.dtype.element_ty)
        b_wn = tl.load(wn + o_k, mask=m_x, other=0.0).to(tl.float32)
        b_x = (b_s.to(tl.float32) * r_m * b_wn).to(x.dtype.element_ty)
    return b_x, b_s


@triton.jit(do_not_specialize=["M", "sx", "su", "sy", "ss"])
def _gemv_kernel(x, u, w, y, wn, s, M, N, sx, su, sy, ss, eps, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, FORM: tl.constexpr, HAS_U: tl.constexpr):
    """y[m, n] = Σ_k a[m, k] w[n, k] for rows m < M (row strides sx, su, sy, ss; last dims
    contiguous), columns n of this program's BN, with a the input of :func:`_row_tile`'s FORM. For
    FORM 2 a first pass over the row gives its 1 / rms, and with HAS_U program 0 stores the residual
    stream s = x + u."""
    pid = tl.program_id(0)
    o_n = pid * BN + tl.arange(0, BN)
    m_n = o_n < N
    o_m = tl.arange(0, BM)
    NK: tl.constexpr = (K + BK - 1) // BK
    rstd = tl.zeros([BM], dtype=tl.float32)
    if FORM == 2:  # 1 / rms of each row of s, from s rounded to x's dtype (the stream's values)
        for m in tl.static_range(BM):
            sq = tl.zeros([BK], dtype=tl.float32)
            for i_k in range(0, NK):
                o_k = i_k * BK + tl.arange(0, BK)
                m_x = (o_k < K) & (m < M)
                b_s = tl.load(x + m * sx + o_k, mask=m_x, other=0.0)
                if HAS_U:
                    b_s = (b_s.to(tl.float32) + tl.load(u + m * su + o_k, mask=m_x, other=0.0).to(tl.float32))
                    b_s = b_s.to(x.dtype.element_ty)
                b_f = b_s.to(tl.float32)
                sq += b_f * b_f
            rstd = tl.where(o_m == m, 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps), rstd)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i_k in range(0, NK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_w = tl.load(w + o_n[:, None].to(tl.int64) * K + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)
        for m in tl.static_range(BM):  # rows past M (BM is M's next power of two) read zeros
            m_x = m_k & (m < M)
            r_m = tl.sum(tl.where(o_m == m, rstd, 0.0), axis=0)
            b_x, b_s = _row_tile(x, u, wn, m, o_k, m_x, sx, su, r_m, FORM, HAS_U)
            if FORM == 2 and HAS_U:
                tl.store(s + m * ss + o_k, b_s, mask=m_x & (pid == 0))
            part = tl.sum(b_w * b_x.to(tl.float32)[None, :], axis=1)
            acc += tl.where(o_m[:, None] == m, part[None, :], 0.0)
    tl.store(y + o_m[:, None] * sy + o_n[None, :], acc.to(y.dtype.element_ty),
             mask=(o_m[:, None] < M) & m_n[None, :])


def tiles(N: int, K: int, device: torch.device) -> tuple[int, int]:
    """(BN, BK): BN the largest power of two ≤ ``OTHER["gemv"]["BN_max"]`` that still gives
    ``programs`` × multiprocessors programs (at least 1); BK = ``elements`` / BN, at most K's next
    power of two and at least 64."""
    cfg = OTHER["gemv"]
    want = cfg["programs"] * sm_count(device)
    BN = 1
    while BN < cfg["BN_max"] and N // (2 * BN) >= want:
        BN *= 2
    BK = max(64, min(cfg["elements"] // BN, pow2(K, 1)))
    return BN, BK


def gemv(x: torch.Tensor, weight: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (``F.linear(SiLU(x) · up, weight)`` with ``up``) for x [..., K] of at
    most ``OTHER["gemv"]["max_rows"]`` rows: weight [N, K] contiguous, x (and up) with a contiguous
    last dim and rows at one stride. Returns [..., N] in x's dtype."""
    return _launch(x, weight, up, 1 if up is not None else 0)[0]


def norm_gemv(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, F.linear(rms_norm(s) · norm_weight, weight))`` with the residual stream s = x + delta
    (rounded to x's dtype; s is x itself without delta), in one launch: a residual add, the RMSNorm
    after it and the projection that reads it. x, delta [..., K] (rows at one stride, contiguous last
    dim), norm_weight [K], weight [N, K]; the norm's output is rounded to x's dtype before the
    product, as the separate norm's is."""
    return _launch(x, weight, delta, 2, norm_weight, eps)


def _launch(x, weight, u, form, norm_weight=None, eps=0.0):
    K = x.shape[-1]
    N = weight.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    u2 = x2 if u is None else u.reshape(-1, K)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    s = torch.empty(M, K, dtype=x.dtype, device=x.device) if form == 2 and u is not None else y
    BN, BK = tiles(N, K, x.device)
    direct(_gemv_kernel, (cdiv(N, BN),), x2, u2, weight, y, norm_weight if form == 2 else weight, s, M, N,
           x2.stride(0), u2.stride(0), y.stride(0), s.stride(0), float(eps),
           K=K, BM=pow2(max(M, 1), 1), BN=BN, BK=BK, FORM=form,
           HAS_U=u is not None, num_warps=OTHER["gemv"]["num_warps"])
    out = y.view(*lead, N)
    if form != 2:
        return out, None
    return (x if u is None else s.view(*lead, K)), out
