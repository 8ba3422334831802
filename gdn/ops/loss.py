"""Language-model head and cross entropy in one autograd Function, over chunks of tokens.

``F.cross_entropy(F.linear(h, W).float(), target)`` keeps the [N, vocab] fp32 log-probabilities
for the backward and builds an fp32 gradient of the same size there (2 GiB each at 16k tokens and
a 32k vocabulary). :func:`linear_cross_entropy` computes the same mean loss chunk by chunk, and
when gradients are wanted it forms them in the same pass, from each chunk's logits while they
exist: dh [N, D] and the weight's gradient (fp32) are kept for the backward, which scales them by
the loss's gradient. The full logits never exist, and the logits are formed once (three matrix
products of the head's size, where a backward recomputing them would run four); the price is
that the weight's gradient is held from the forward on instead of being allocated in the backward.

Under ``torch.compile`` it is the custom op ``gdn::linear_cross_entropy`` (the loss and, where
asked, both gradients), whose backward scales them.
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


def lce_forward(h, weight, target, ignore_index: int, dtype: torch.dtype, need_dh: bool = False,
                need_dw: bool = False):
    """``(loss, dh or None, dw or None)``: the mean loss over the kept tokens (fp32 softmax, fp64 for
    fp64) and, where asked, its gradients for a unit gradient of the loss, from the same logits of
    each chunk: dh in h's dtype, dw summed in fp32 (fp64) and returned in the weight's dtype."""
    N = h.shape[0]
    rows = _chunk_rows(N, weight.shape[0])
    keep, tgt, n_kept = _kept(target, ignore_index)
    sdt = torch.promote_types(dtype, torch.float32)  # softmax dtype: fp32, or fp64
    grads = need_dh or need_dw
    lse = torch.empty(N, device=h.device, dtype=sdt)
    picked = torch.empty(N, device=h.device, dtype=sdt)
    coef = keep.to(sdt) / n_kept if grads else None  # each row's factor of the loss's gradient
    dh = torch.empty_like(h) if need_dh else None
    dw = torch.zeros(weight.shape, device=weight.device, dtype=sdt) if need_dw else None
    with torch.autocast(h.device.type, enabled=False):
        w = weight.to(dtype)
        for s in range(0, N, rows):
            e = min(N, s + rows)
            hc = h[s:e].to(dtype)
            z = hc @ w.t()
            tri = _row_passes(z, sdt)
            if tri is not None:  # one pass over the half-precision logits, and one more for the gradient
                lse[s:e], picked[s:e] = tri.logsumexp_pick(z, tgt[s:e])
                pc = tri.softmax_grad(z, lse[s:e], tgt[s:e], coef[s:e]) if grads else None
            else:
                z = z.to(sdt)
                lse[s:e] = torch.logsumexp(z, -1)
                picked[s:e] = z.gather(1, tgt[s:e, None])[:, 0]
                pc = None
                if grads:
                    p = torch.exp(z - lse[s:e, None])  # softmax, fp32 (or fp64)
                    p[torch.arange(e - s, device=p.device), tgt[s:e]] -= 1.0
                    p *= coef[s:e, None]
                    pc = p.to(dtype)
                    del p
            del z
            if dh is not None:
                dh[s:e] = (pc @ w).to(h.dtype)
            if dw is not None:
                accumulate_product(dw, pc.t(), hc)
            del pc
    loss = torch.where(keep, lse - picked, 0.0).sum() / n_kept  # NaN when nothing is kept, as F.cross_entropy
    return loss, dh, None if dw is None else dw.to(weight.dtype)


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


class _LinearCrossEntropyFn(torch.autograd.Function):
    """Mean over the kept tokens of ``logsumexp(z) − z[target]`` with ``z = h Wᵀ`` (fp32 softmax).

    h: [N, D]; weight: [V, D]; target: [N] int (``ignore_index`` skipped); matmuls in ``dtype``.
    ``grads``: whether gradient mode is on at the call (inside ``forward`` it never is); then the
    gradients of the inputs that need one are formed here and the backward scales them."""

    @staticmethod
    def forward(ctx, h, weight, target, ignore_index: int, dtype: torch.dtype, grads: bool):
        need_dh, need_dw = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        loss, dh, dw = lce_forward(h, weight, target, ignore_index, dtype, need_dh, need_dw)
        ctx.save_for_backward(dh, dw)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        dh, dw = ctx.saved_tensors
        return _scaled(dh, dloss), _scaled(dw, dloss), None, None, None, None


def _scaled(grad, dloss):
    """``grad`` (formed for a unit gradient of the loss) times the loss's gradient ``dloss``, in
    grad's dtype (the product in fp32 or wider; a half-precision dh is rounded once more where
    dloss is not a power of two), or None where no gradient was formed."""
    if grad is None:
        return None
    return grad * dloss.to(torch.promote_types(grad.dtype, torch.float32))


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
    grads = torch.is_grad_enabled()
    if library.compiling():
        need_dh, need_dw = grads and h.requires_grad, grads and weight.requires_grad
        return _lce_op(h, weight, target.to(h.device), int(ignore_index), dtype, need_dh, need_dw)[0]
    return _LinearCrossEntropyFn.apply(h, weight, target.to(h.device), ignore_index, dtype, grads)


# ---- the custom ops (torch.compile) -------------------------------------------------------------

@torch.library.custom_op("gdn::linear_cross_entropy", mutates_args=())
def _lce_op(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, dtype: torch.dtype,
            need_dh: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss [], dh, dw): the gradients for a unit gradient of the loss, each empty where not asked."""
    loss, dh, dw = lce_forward(h, weight, target, ignore_index, dtype, need_dh, need_dw)
    return loss, (dh if dh is not None else h.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@_lce_op.register_fake
def _(h, weight, target, ignore_index, dtype, need_dh, need_dw):
    sdt = torch.promote_types(dtype, torch.float32)
    return (h.new_empty((), dtype=sdt), h.new_empty(h.shape if need_dh else (0,)),
            weight.new_empty(weight.shape if need_dw else (0,)))


def _lce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.asked = inputs[5], inputs[6]  # need_dh, need_dw: the outputs that are gradients, not placeholders


def _lce_grad(ctx, dloss, _ddh, _ddw):
    grads = [g if asked else None for g, asked in zip(ctx.saved_tensors, ctx.asked)]
    return _scaled(grads[0], dloss), _scaled(grads[1], dloss), None, None, None, None, None


_lce_op.register_autograd(_lce_grad, setup_context=_lce_setup)
