"""The one rule that decides which implementation runs a call, for every op family.

Implementations:

- ``"naive"``: the token-by-token recurrence (``delta/reference.py``, ``kda/reference.py``), the spec;
- ``"chunk"``: the chunkwise-parallel PyTorch form, any device, autograd;
- ``"triton-chunk"``: the Triton chunk kernels, with autograd;
- ``"triton-recurrent"``: the Triton token-recurrent kernels (decode and short prefills).

The rule, from the call's device, dtype, length and the ``backend`` argument:

1. ``backend="naive"`` or ``"chunk"`` runs that form.
2. ``backend="triton"`` needs CUDA tensors and Triton installed, else it raises ``ValueError``
   (nothing falls back silently). ``backend=None`` takes Triton for CUDA tensors when Triton is
   installed; otherwise the recurrence for a decode step (every sequence one token long: O(K·V)
   per head) and the chunk form for anything longer.
3. On Triton: the token-recurrent kernels when no input needs a gradient, the whole packed
   stream has at most :data:`gdn.ops.tuning.RECURRENT_MAX_T` tokens, q/k/v are fp32, fp16 or
   bf16 and K, V ≤ :data:`gdn.ops.tuning.MAX_HEAD_DIM`; the chunk kernels otherwise. KDA with
   V > ``MAX_HEAD_DIM`` takes its token-recurrent kernels (which have a backward) whatever the length.
4. Heads the kernels do not take (K > ``MAX_HEAD_DIM``; for the scalar-gate family also
   V > ``MAX_HEAD_DIM``) run the chunk form with ``backend=None`` and raise with ``"triton"``.

Glue ops (norms, short convolution, SwiGLU, the loss rows) take their Triton kernel exactly when
:func:`use_triton` says so, and their PyTorch function otherwise.
"""
from __future__ import annotations

import torch

from .tuning import MAX_HEAD_DIM, RECURRENT_MAX_T

try:
    import triton  # noqa: F401
except ImportError:  # a CPU-only install without the test extras
    HAS_TRITON = False
else:
    HAS_TRITON = True

BACKENDS = ("naive", "chunk", "triton")
NAIVE, CHUNK, TRITON_CHUNK, TRITON_RECURRENT = "naive", "chunk", "triton-chunk", "triton-recurrent"
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["HAS_TRITON", "BACKENDS", "route", "use_triton", "needs_grad", "decode_step", "available_backends"]


def use_triton(x: torch.Tensor) -> bool:
    """Whether work on ``x`` runs Triton kernels: ``x`` is a CUDA tensor and Triton is installed."""
    return x.is_cuda and HAS_TRITON


def needs_grad(*xs) -> bool:
    """Whether autograd will want a gradient of any of the tensors ``xs`` (None entries ignored)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def decode_step(T: int, cu_seqlens) -> bool:
    """Whether a call of T tokens is a decode step: every sequence exactly one token long (T == 1, or
    packed offsets [0, 1, …, N]). Under torch.compile the offsets' values are not read: a packed call
    then counts as no decode step (the chunk form runs any lengths)."""
    if cu_seqlens is None:
        return T == 1
    if T != cu_seqlens.numel() - 1 or torch.compiler.is_compiling():
        return False
    return bool((cu_seqlens[1:] - cu_seqlens[:-1] == 1).all())


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on ``device``."""
    out = ["naive", "chunk"]
    if torch.device(device).type == "cuda" and HAS_TRITON:
        out.append("triton")
    return out


def route(op: str, backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, decode_step: bool,
          grad: bool, kda: bool = False) -> str:
    """The implementation (one of ``"naive" "chunk" "triton-chunk" "triton-recurrent"``) of a
    validated call of ``op`` (for the error message) by the rule of this module's docstring.

    q, k: [B, T, H, K]; v: [B, T, HV, V]; ``decode_step``: every sequence is one token long;
    ``grad``: some input needs a gradient; ``kda``: the per-channel-gate family."""
    if backend == NAIVE or backend == CHUNK:
        return backend
    if backend == "triton" and not use_triton(q):
        raise ValueError(
            f"backend='triton' cannot run {op} here: it needs CUDA tensors (q is on {q.device}) and "
            f"Triton ({'installed' if HAS_TRITON else 'not installed'}); use backend='chunk'")
    K, V = q.shape[-1], v.shape[-1]
    too_wide = K > MAX_HEAD_DIM or (V > MAX_HEAD_DIM and not kda)
    if backend == "triton" and too_wide:
        raise ValueError(f"backend='triton' cannot run {op} with K = {K}, V = {V}: the kernels take heads of at "
                         f"most {MAX_HEAD_DIM}; use backend='chunk'")
    if backend is None and (not use_triton(q) or too_wide):
        return NAIVE if decode_step else CHUNK
    if kda and V > MAX_HEAD_DIM:
        return TRITON_RECURRENT
    short = q.shape[1] <= RECURRENT_MAX_T and max(K, V) <= MAX_HEAD_DIM
    kernel_dtypes = all(x.dtype in _KERNEL_DTYPES for x in (q, k, v))
    return TRITON_RECURRENT if short and kernel_dtypes and not grad else TRITON_CHUNK
