"""Row-wise passes of the chunked head + cross entropy (:mod:`gdn.ops.loss`) on the GPU.

The loss works on one chunk of logits ``z`` [R, V] (the matmul's output, bf16 under autocast) at a
time. In PyTorch, the forward converts z to fp32 and runs log-sum-exp and a gather (four passes over
an fp32 copy), the backward six (convert, subtract, exp, index, scale, convert back). Here:

    lse, picked = logsumexp_pick(z, target)             # one pass over z: fp32 [R] each
    dz = softmax_grad(z, lse, target, coef)             # one pass: (softmax(z) − onehot(target)) · coef, in z's dtype

with ``coef`` [R] fp32 the per-row factor of the loss gradient (0 for ignored rows). Math in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tuning import OTHER, cdiv, pow2
from .launch import direct



@triton.jit
def _lse_pick_kernel(z, target, lse, picked, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z + row * V
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    start = 0
    while start < V:  # (a while loop: the CPU interpreter cannot run a for loop to a run-time bound)
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # lanes that have seen only -inf keep s = 0 (shifting by 0 there avoids exp(-inf - -inf))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
        start += BLOCK
    mx = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - mx), axis=0)
    tl.store(lse + row, mx + tl.log(total))
    t = tl.load(target + row)
    tl.store(picked + row, tl.load(base + t).to(tl.float32))


@triton.jit
def _softmax_grad_kernel(z, lse, target, coef, dz, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(z + row * V + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(x - tl.load(lse + row))
    p = tl.where(cols == tl.load(target + row), p - 1.0, p) * tl.load(coef + row)
    tl.store(dz + row * V + cols, p.to(dz.dtype.element_ty), mask=mask)


def _rows(z: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if z.dim() != 2:
        raise ValueError(f"z must be a [R, V] tensor, got shape {tuple(z.shape)}")
    if target.shape != z.shape[:1] or target.is_floating_point():
        raise ValueError(f"target must be an integer tensor of shape [{z.shape[0]}], got {target.dtype} "
                         f"{tuple(target.shape)}")
    return z.contiguous(), target.contiguous()


def logsumexp_pick(z: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp(z, -1), z[r, target[r]]) as fp32 [R] each. z: [R, V]; target: [R] int in [0, V)."""
    z, target = _rows(z, target)
    R, V = z.shape
    lse = torch.empty(R, device=z.device, dtype=torch.float32)
    picked = torch.empty(R, device=z.device, dtype=torch.float32)
    c = OTHER["cross_entropy"]
    if R:
        direct(_lse_pick_kernel, (R,), z, target, lse, picked, V, BLOCK=min(c["BLOCK"], pow2(V, 1)),
               num_warps=c["num_warps"])
    return lse, picked


def softmax_grad(z: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """(exp(z − lse) − onehot(target)) · coef per row, in z's dtype. z: [R, V]; lse, coef: [R] fp32."""
    z, target = _rows(z, target)
    R, V = z.shape
    dz = torch.empty_like(z)
    c = OTHER["cross_entropy"]
    if R:
        B = min(c["BLOCK"], pow2(V, 1))
        direct(_softmax_grad_kernel, (R, cdiv(V, B)), z, lse.float().contiguous(), target, coef.float().contiguous(),
               dz, V, BLOCK=B, num_warps=c["num_warps"])
    return dz
