"""Products of a decode step's few rows by a weight: ``decode_linear``.

On CUDA with at most ``OTHER["gemv"]["max_rows"]`` rows (batch 1 to 4 of a decode step) the product
runs as one streaming pass over the weight (:mod:`gdn.ops.triton.gemv`), which reaches a larger
share of the card's bandwidth than cuBLAS's kernels for these shapes; anything else (more rows, the
CPU, a gradient, ``torch.compile``) is PyTorch's ``F.linear``. Both accumulate in fp32 and round
once; the results differ by that rounding's order only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import library
from .norm import add_rms_norm, rms_norm
from .router import HAS_TRITON, use_triton
from .swiglu import swiglu_down
from .tuning import OTHER

if HAS_TRITON:
    from .triton import gemv as kernels

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _streams(x: torch.Tensor, weight: torch.Tensor, up: torch.Tensor | None) -> bool:
    """Whether the Triton pass takes this product."""
    if not use_triton(x) or library.compiling():
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (up is not None and up.requires_grad)):
        return False
    K = x.shape[-1]
    return (x.numel() // max(K, 1) <= OTHER["gemv"]["max_rows"] and x.dtype in _DTYPES and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] == K and x.stride(-1) == 1
            and (up is None or (up.shape == x.shape and up.dtype == x.dtype and up.stride(-1) == 1)))


def decode_linear(x: torch.Tensor, weight: torch.Tensor, up: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight)``; with ``up``, ``F.linear(SiLU(x) · up, weight)`` (x the gate, the
    product computed in ``dtype``, default x's). x [..., K], weight [N, K] -> [..., N]."""
    if _streams(x, weight, up) and (dtype is None or dtype == x.dtype):
        return kernels.gemv(x, weight, up)
    if up is None:
        return F.linear(x, weight)
    return swiglu_down(x, up, weight, dtype or x.dtype)


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, norm_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, F.linear(rms_norm(s, norm_weight, eps, norm_dtype), weight))`` with the residual stream
    s = x + delta (x itself when delta is None): the add, the RMSNorm after it and the projection
    that reads the norm, as one streaming pass where :func:`decode_linear` takes the product and the
    norm is in x's dtype (the pass forms each row's norm itself); the norm's ops and
    :func:`decode_linear` otherwise."""
    take = (_streams(x, weight, delta) and norm_dtype == x.dtype and norm_weight.dim() == 1
            and norm_weight.is_contiguous() and norm_weight.dtype == x.dtype
            and not (torch.is_grad_enabled() and norm_weight.requires_grad))
    if take:
        return kernels.norm_gemv(x, delta, norm_weight, eps, weight)
    if delta is None:
        s, h = x, rms_norm(x, norm_weight, eps, norm_dtype)
    else:
        s, h = add_rms_norm(x, delta, norm_weight, eps, norm_dtype)
    return s, decode_linear(h, weight)
