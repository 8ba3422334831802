"""Token-mixer ops: pure functions, tensors in and out (DESIGN §2).

Every op validates its arguments, then runs one backend:

- ``"naive"``: the token-by-token recurrence (:mod:`gdn.ops.reference`), the specification;
- ``"chunk"``: the chunkwise-parallel PyTorch form (:mod:`gdn.ops.chunk`), any device, autograd;
- ``"triton"``: GPU kernels (:mod:`gdn.ops.triton`), CUDA tensors only.

``backend=None`` picks: Triton for CUDA tensors when it is installed; the recurrence for a
decode step (every sequence one token long, O(K·V) per head); the chunk form otherwise.
An explicit backend that cannot run the call raises; nothing falls back silently.
"""
from __future__ import annotations


import torch

from . import attention as _attention
from . import chunk as _chunk
from . import kda_chunk as _kda_chunk
from . import kda_reference as _kda_reference
from . import reference as _reference
from ._checks import check_attention, check_recurrent

_KDA = "kimi_delta_attention"

__all__ = [
    "linear_attention",
    "gated_linear_attention",
    "delta_rule",
    "gated_delta_rule",
    "kimi_delta_attention",
    "softmax_attention",
    "available_backends",
]


def _triton_module():
    """The Triton backend module, or None when Triton (or the kernels) cannot be imported."""
    try:
        from . import triton as _triton  # noqa: PLC0415
    except ImportError:
        return None
    return _triton if getattr(_triton, "AVAILABLE", False) else None


def triton_kernels(name: str, x: torch.Tensor):
    """The Triton kernel module ``gdn.ops.triton.<name>`` for work on ``x``: the module when ``x`` is a
    CUDA tensor and Triton imports, else None (the caller takes its PyTorch path). The layers use it
    for their GPU passes (short conv, norms, SwiGLU, the loss rows, KDA)."""
    if not x.is_cuda or _triton_module() is None:
        return None
    import importlib  # noqa: PLC0415

    try:
        return importlib.import_module(f"{__name__}.triton.{name}")
    except ImportError:
        return None


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run on ``device``."""
    out = ["naive", "chunk"]
    if torch.device(device).type == "cuda" and _triton_module() is not None:
        out.append("triton")
    return out


def _is_decode_step(dims, cu_seqlens) -> bool:
    return dims.T == 1 if cu_seqlens is None else dims.T == dims.N


def _triton_fn(op: str):
    """The Triton implementation of ``op``, or None when it cannot be imported."""
    mod = _triton_module()
    if mod is None:
        return None
    if op == _KDA:
        try:
            from .triton import kda  # noqa: PLC0415
        except ImportError:
            return None
        return getattr(kda, op, None)
    return getattr(mod, op, None)


def _dispatch(op: str, backend, q, dims, cu_seqlens):
    """Return ``(backend, function)`` implementing ``op`` (backend None: pick)."""
    decode = _is_decode_step(dims, cu_seqlens)
    if backend is None:
        if q.is_cuda and _triton_fn(op) is not None:
            backend = "triton"
        elif decode:
            backend = "naive"
        else:
            backend = "chunk"
    if backend == "naive":
        return backend, getattr(_kda_reference if op == _KDA else _reference, op)
    if backend == "chunk":
        return backend, getattr(_kda_chunk if op == _KDA else _chunk, op)
    fn = _triton_fn(op)
    if not q.is_cuda or fn is None:
        raise ValueError(
            f"backend='triton' cannot run {op} here: it needs CUDA tensors (q is on {q.device}) and the "
            f"Triton kernels ({'not importable' if fn is None else 'importable'}); use backend='chunk'"
        )
    return backend, fn


def _recurrent_call(op, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, backend):
    if op == _KDA:
        dims = _kda_reference.check_kda(q, k, v, g, beta, initial_state, cu_seqlens, scale, backend)
    else:
        dims = check_recurrent(q, k, v, g, beta, initial_state, cu_seqlens, scale, backend)
    backend, fn = _dispatch(op, backend, q, dims, cu_seqlens)
    args = [x for x in (g, beta) if x is not None]
    if backend == "naive" and cu_seqlens is not None and dims.T == dims.N:
        # A decode step of N packed one-token sequences is a batch of N: no per-sequence loop.
        def as_batch(x):
            return x.transpose(0, 1)

        o, S = fn(as_batch(q), as_batch(k), as_batch(v), *[as_batch(a) for a in args], scale=scale,
                  initial_state=initial_state, output_final_state=output_final_state)
        return o.transpose(0, 1), S
    return fn(q, k, v, *args, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens)


def linear_attention(q, k, v, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     backend=None):
    """Linear attention: ``S_t = S_{t-1} + k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``.

    Shapes as in :func:`gated_delta_rule`. Returns ``(o, final_state or None)``.
    """
    return _recurrent_call("linear_attention", q, k, v, None, None, scale, initial_state, output_final_state,
                           cu_seqlens, backend)


def gated_linear_attention(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, backend=None):
    """Gated linear attention with a Mamba2-style scalar decay: ``S_t = exp(g_t) S_{t-1} + k_t v_tᵀ``.

    ``g``: [B, T, HV], the log of the decay (≤ 0). Other shapes as in :func:`gated_delta_rule`.
    """
    return _recurrent_call("gated_linear_attention", q, k, v, g, None, scale, initial_state, output_final_state,
                           cu_seqlens, backend)


def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
               backend=None):
    """DeltaNet: ``S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``. ``beta``: [B, T, HV].

    Keys are expected L2-normalised (with ``β ∈ [0, 2]`` the update is a contraction).
    """
    return _recurrent_call("delta_rule", q, k, v, None, beta, scale, initial_state, output_final_state,
                           cu_seqlens, backend)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, backend=None):
    """Gated DeltaNet: ``S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``, ``o_t = scale · S_tᵀ q_t``.

    Args:
        q, k: [B, T, H, K] queries and (L2-normalised) keys.
        v: [B, T, HV, V] values; HV a multiple of H (value head j reads q/k head ``j // (HV // H)``).
        g: [B, T, HV] log decay (≤ 0); beta: [B, T, HV] write strength.
        scale: query scale, default ``K ** -0.5``.
        initial_state: [N, HV, K, V] state to start from (N = B, or the number of packed sequences).
        output_final_state: also return the final state [N, HV, K, V] (fp32, or fp64 for fp64 input).
        cu_seqlens: [N + 1] offsets of sequences packed along T (then B == 1).
        backend: ``"naive" | "chunk" | "triton" | None``.

    Returns:
        ``(o, S)``: o [B, T, HV, V] in ``v.dtype``; S the final state or None.
    """
    return _recurrent_call("gated_delta_rule", q, k, v, g, beta, scale, initial_state, output_final_state,
                           cu_seqlens, backend)


def kimi_delta_attention(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                         cu_seqlens=None, backend=None):
    """Kimi Delta Attention: the gated delta rule with a per-channel gate,
    ``S_t = (I − β_t k_t k_tᵀ) diag(exp g_t) S_{t-1} + β_t k_t v_tᵀ`` (decay along K first, then the delta
    correction: the order of the reference, the chunk form and FLA; with a per-channel gate the two
    orders differ).

    ``g``: [B, T, HV, K] log decay per key channel (≤ 0); other shapes as in :func:`gated_delta_rule`.
    """
    return _recurrent_call(_KDA, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, backend)


def softmax_attention(q, k, v, *, scale=None, causal=True, window_size=None, cu_seqlens=None, backend=None):
    """Softmax attention (the baseline mixer).

    q: [B, T, HQ, K]; k: [B, T, HKV, K]; v: [B, T, HKV, V]; HQ a multiple of HKV (grouped query
    heads). ``window_size`` W (needs ``causal``) lets query t see keys t−W+1..t. ``cu_seqlens``
    packs sequences along T (B == 1). ``backend``: ``"naive"`` (explicit masked scores) or
    ``None``/``"chunk"`` (SDPA). Returns o: [B, T, HQ, V] in v.dtype.
    """
    check_attention(q, k, v, cu_seqlens, scale, window_size, backend)
    if window_size is not None and not causal:
        raise ValueError("window_size requires causal=True (a sliding window looks back only)")
    if backend == "triton":
        raise ValueError("softmax_attention has no 'triton' backend: use None (SDPA, flash on CUDA) or 'naive'")
    fn = _reference.softmax_attention if backend == "naive" else _attention.softmax_attention
    return fn(q, k, v, scale=scale, causal=causal, window_size=window_size, cu_seqlens=cu_seqlens)
