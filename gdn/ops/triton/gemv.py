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

from ..tuning import OTHER
from .launch import sm_count


@triton.jit(do_not_specialize=["M", "sx", "su", "sy"])
def _gemv_kernel(x, u, w, y, M, N, sx, su, sy, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GLU: tl.constexpr):
    """y[m, n] = Σ_k x[m, k] w[n, k] for rows m < M (row strides sx, su, sy; last dims contiguous),
    columns n of this program's BN; with GLU, x[m, k] replaced by SiLU(x[m, k]) · u[m, k]."""
    o_n = tl.program_id(0) * BN + tl.arange(0, BN)
    m_n = o_n < N
    o_m = tl.arange(0, BM)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i_k in range(0, (K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_w = tl.load(w + o_n[:, None].to(tl.int64) * K + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)
        for m in tl.static_range(BM):  # rows past M (BM is M's next power of two) read zeros
            m_x = m_k & (m < M)
            b_x = tl.load(x + m * sx + o_k, mask=m_x, other=0.0)
            if GLU:
                b_g = b_x.to(tl.float32)
                b_u = tl.load(u + m * su + o_k, mask=m_x, other=0.0).to(tl.float32)
                b_x = (b_g * tl.sigmoid(b_g) * b_u).to(x.dtype.element_ty)
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
    BK = max(64, min(cfg["elements"] // BN, triton.next_power_of_2(K)))
    return BN, BK


def gemv(x: torch.Tensor, weight: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (``F.linear(SiLU(x) · up, weight)`` with ``up``) for x [..., K] of at
    most ``OTHER["gemv"]["max_rows"]`` rows: weight [N, K] contiguous, x (and up) with a contiguous
    last dim and rows at one stride. Returns [..., N] in x's dtype."""
    K = x.shape[-1]
    N = weight.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    u2 = x2 if up is None else up.reshape(-1, K)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    BN, BK = tiles(N, K, x.device)
    _gemv_kernel[(triton.cdiv(N, BN),)](x2, u2, weight, y, M, N, x2.stride(0), u2.stride(0), y.stride(0),
                                        K=K, BM=triton.next_power_of_2(max(M, 1)), BN=BN, BK=BK, GLU=up is not None,
                                        num_warps=OTHER["gemv"]["num_warps"])
    return y.view(*lead, N)
