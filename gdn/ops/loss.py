"""Language-model head and cross entropy in one autograd Function, over chunks of tokens.

``F.cross_entropy(F.linear(h, W).float(), target)`` keeps the [N, vocab] fp32 log-probabilities
for the backward and builds an fp32 gradient of the same size there (2 GiB each at 16k tokens and
a 32k vocabulary). :func:`linear_cross_entropy` computes the same mean loss chunk by chunk,
keeping only h, the weight, the targets and one log-sum-exp per token; the backward recomputes the
logits of one chunk at a time. The full logits never exist.

Under ``torch.compile`` it is the custom op ``gdn::linear_cross_entropy`` (loss and the
log-sum-exps) with its backward ``gdn::linear_cross_entropy_backward`` (:mod:`gdn.ops.library`):
the Function's own forward and backward passes.
"""
from __future__ import annotations

import torch

from . import library
from .router import HAS_TRITON, use_triton

if HAS_TRITON:
    from .triton import cross_entropy as kernels

#: Logit elements per chunk (×4 bytes in fp32): bounds the transient memory of both passes.
CHUNK_ELEMENTS = 2**25


def _row_passes(z: torch.Tensor, sdt: torch.dtype):
    """:mod:`gdn.ops.triton.cross_entropy` for CUDA logits with an fp32 softmax, else None (PyTorch)."""
    return kernels if use_triton(z) and sdt == torch.float32 else None


def _chunk_rows(n: int, vocab: int) -> int:
    return max(1, min(n, CHUNK_ELEMENTS // vocab))


def _kept(target, ignore_index: int):
    """(keep [N] bool, target with ignored rows at class 0 [N], number kept)."""
    keep = target != ignore_index
    return keep, torch.where(keep, target, 0), keep.sum()


def lce_forward(h, weight, target, ignore_index: int, dtype: torch.dtype):
    """``(loss, lse [N], tgt, keep, n_kept)``: the mean loss over the kept tokens (fp32 softmax, fp64
    for fp64), the log-sum-exp of every row and what :func:`lce_backward` needs of the targets."""
    N = h.shape[0]
    rows = _chunk_rows(N, weight.shape[0])
    keep, tgt, n_kept = _kept(target, ignore_index)
    sdt = torch.promote_types(dtype, torch.float32)  # softmax dtype: fp32, or fp64
    lse = torch.empty(N, device=h.device, dtype=sdt)
    picked = torch.empty(N, device=h.device, dtype=sdt)
    with torch.autocast(h.device.type, enabled=False):
        w = weight.to(dtype)
        for s in range(0, N, rows):
            z = h[s:s + rows].to(dtype) @ w.t()
            tri = _row_passes(z, sdt)
            if tri is not None:  # one pass over the half-precision logits
                lse[s:s + rows], picked[s:s + rows] = tri.logsumexp_pick(z, tgt[s:s + rows])
            else:
                z = z.to(sdt)
                lse[s:s + rows] = torch.logsumexp(z, -1)
                picked[s:s + rows] = z.gather(1, tgt[s:s + rows, None])[:, 0]
            del z
    loss = torch.where(keep, lse - picked, 0.0).sum() / n_kept  # NaN when nothing is kept, as F.cross_entropy
    return loss, lse, tgt, keep, n_kept


def accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for an fp32 ``acc`` and half-precision ``a``, ``b``. On CUDA the product is
    summed into ``acc`` by the matrix product itself (cuBLAS's β = 1 with an fp32 output): no
    half-precision product rounded, cast and added in passes of their own, which at a 32000-word head
    and 16 chunks of tokens moved ≈ 10 GB a step (3.9 ms on an H100); the sum is also exact up to the
    fp32 accumulation, not to one bf16 rounding per chunk. Elsewhere (the CPU has no mixed-dtype
    product), the product is formed in the inputs' dtype and added in fp32."""
    if _FP32_OUT[0] and acc.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and acc.dtype == torch.float32:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without it (before 2.8)
            _FP32_OUT[0] = False
    acc += (a @ b).to(acc.dtype)


#: whether this torch's matrix product takes ``out_dtype`` (found at the first call that tries it)
_FP32_OUT = [True]


def lce_backward(dloss, h, weight, tgt, keep, lse, n_kept, dtype: torch.dtype, need_dh: bool, need_dw: bool):
    """``(dh or None, dw or None)`` of :func:`lce_forward`, recomputing the logits chunk by chunk."""
    dt = dtype
    N = h.shape[0]
    rows = _chunk_rows(N, weight.shape[0])
    sdt = lse.dtype
    scale = (dloss / n_kept).to(sdt)
    dh = torch.empty_like(h) if need_dh else None
    dw = torch.zeros(weight.shape, device=weight.device, dtype=sdt) if need_dw else None
    with torch.autocast(h.device.type, enabled=False):
        w = weight.to(dt)
        for s in range(0, N, rows):
            e = min(N, s + rows)
            hc = h[s:e].to(dt)
            z = hc @ w.t()
            tri = _row_passes(z, sdt)
            if tri is not None:  # (softmax − onehot) · coef in one pass, in dt
                pc = tri.softmax_grad(z, lse[s:e], tgt[s:e], keep[s:e].to(sdt) * scale)
            else:
                p = torch.exp(z.to(sdt) - lse[s:e, None])  # softmax, fp32 (or fp64)
                p[torch.arange(e - s, device=p.device), tgt[s:e]] -= 1.0
                p *= (keep[s:e].to(p.dtype) * scale)[:, None]
                pc = p.to(dt)
                del p
            del z
            if dh is not None:
                dh[s:e] = (pc @ w).to(h.dtype)
            if dw is not None:
                accumulate_product(dw, pc.t(), hc)
    return dh, None if dw is None else dw.to(weight.dtype)


class _LinearCrossEntropyFn(torch.autograd.Function):
    """Mean over the kept tokens of ``logsumexp(z) − z[target]`` with ``z = h Wᵀ`` (fp32 softmax).

    h: [N, D]; weight: [V, D]; target: [N] int (``ignore_index`` skipped); matmuls in ``dtype``."""

    @staticmethod
    def forward(ctx, h, weight, target, ignore_index: int, dtype: torch.dtype):
        loss, lse, tgt, keep, n_kept = lce_forward(h, weight, target, ignore_index, dtype)
        ctx.save_for_backward(h, weight, tgt, keep, lse, n_kept)
        ctx.dtype = dtype
        return loss

    @staticmethod
    def backward(ctx, dloss):
        h, weight, tgt, keep, lse, n_kept = ctx.saved_tensors
        dh, dw = lce_backward(dloss, h, weight, tgt, keep, lse, n_kept, ctx.dtype, ctx.needs_input_grad[0],
                              ctx.needs_input_grad[1])
        return dh, dw, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross entropy of the logits ``h Wᵀ`` without materialising them.

    Args:
        h: [N, D] hidden states (the head's input).
        weight: [V, D] head weight.
        target: [N] integer classes in [0, V), or ``ignore_index`` (not counted).
        ignore_index: target value to skip.

    The matmuls run in the autocast dtype when autocast is on for ``h``'s device (as ``F.linear``
    would), else in ``h.dtype``; the softmax and the loss in fp32 (fp64 for fp64). Returns a 0-d tensor, NaN
    when every target is ignored (as ``F.cross_entropy``).
    """
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"h must be a [N, D] tensor, got {tuple(h.shape) if isinstance(h, torch.Tensor) else h!r}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise ValueError(f"weight must have shape [V, {h.shape[1]}], got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else weight!r}")
    if not isinstance(target, torch.Tensor) or target.shape != h.shape[:1] or target.is_floating_point():
        raise ValueError(f"target must be an integer tensor of shape [N] = [{h.shape[0]}], got "
                         f"{(target.dtype, tuple(target.shape)) if isinstance(target, torch.Tensor) else target!r}")
    dtype = library.autocast_of(h) or h.dtype
    if library.compiling():
        return _lce_op(h, weight, target.to(h.device), int(ignore_index), dtype)[0]
    return _LinearCrossEntropyFn.apply(h, weight, target.to(h.device), ignore_index, dtype)


# ---- the custom ops (torch.compile) -------------------------------------------------------------

@torch.library.custom_op("gdn::linear_cross_entropy", mutates_args=())
def _lce_op(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [], lse [N]): the backward needs the log-sum-exps; the rest it rebuilds from ``target``."""
    loss, lse, _, _, _ = lce_forward(h, weight, target, ignore_index, dtype)
    return loss, lse


@_lce_op.register_fake
def _(h, weight, target, ignore_index, dtype):
    sdt = torch.promote_types(dtype, torch.float32)
    return h.new_empty((), dtype=sdt), h.new_empty(h.shape[0], dtype=sdt)


@torch.library.custom_op("gdn::linear_cross_entropy_backward", mutates_args=())
def _lce_backward_op(dloss: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                     lse: torch.Tensor, ignore_index: int, dtype: torch.dtype, need_dh: bool,
                     need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, dw), each empty where not needed."""
    keep, tgt, n_kept = _kept(target, ignore_index)
    dh, dw = lce_backward(dloss, h, weight, tgt, keep, lse, n_kept, dtype, need_dh, need_dw)
    return (dh if dh is not None else h.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@_lce_backward_op.register_fake
def _(dloss, h, weight, target, lse, ignore_index, dtype, need_dh, need_dw):
    return h.new_empty(h.shape if need_dh else (0,)), weight.new_empty(weight.shape if need_dw else (0,))


def _lce_setup(ctx, inputs, output):
    h, weight, target, ignore_index, dtype = inputs
    ctx.save_for_backward(h, weight, target, output[1])
    ctx.ignore_index, ctx.dtype = ignore_index, dtype


def _lce_grad(ctx, dloss, _dlse):
    h, weight, target, lse = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dh, dw = _lce_backward_op(dloss, h, weight, target, lse, ctx.ignore_index, ctx.dtype, need_dh, need_dw)
    return (dh if need_dh else None), (dw if need_dw else None), None, None, None


_lce_op.register_autograd(_lce_grad, setup_context=_lce_setup)
