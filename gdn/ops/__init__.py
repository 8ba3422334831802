"""Token-mixer ops: pure functions, tensors in and out.

Every op validates its arguments (:mod:`.checks`), asks :mod:`.router` which implementation runs
the call (the one rule: naive / chunk / Triton chunk kernels / Triton token-recurrent kernels),
and runs it. Families live in their folders with their spec beside their kernels:
:mod:`.delta` (the four scalar-gate members), :mod:`.kda` (Kimi Delta Attention),
:mod:`.attention` (softmax attention). A decode step that updates the state in place:
:func:`recurrent_step_`, :func:`gated_delta_rule_fused_step_` (:mod:`.delta.step`). Glue ops of
the layers: :mod:`.norm`, :mod:`.conv`, :mod:`.swiglu`, :mod:`.loss`; formulas shared by all:
:mod:`.gates`; every kernel's launch settings: :mod:`.tuning`.
"""
from __future__ import annotations

from . import attention as _attention
from . import delta, kda, library
from .checks import check_attention, check_recurrent
from .delta.fused import gated_delta_rule_fused
from .delta.step import gated_delta_rule_fused_step_, recurrent_step_
from .kda.reference import check_kda
from .router import available_backends, needs_grad, route

__all__ = [
    "linear_attention",
    "gated_linear_attention",
    "delta_rule",
    "gated_delta_rule",
    "gated_delta_rule_fused",
    "recurrent_step_",
    "gated_delta_rule_fused_step_",
    "kimi_delta_attention",
    "softmax_attention",
    "available_backends",
]


def _recurrent_call(op, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, backend):
    is_kda = op == "kimi_delta_attention"
    check = check_kda if is_kda else check_recurrent
    dims = check(q, k, v, g, beta, initial_state, cu_seqlens, scale, backend)
    impl = route(op, backend, q, k, v, decode_step=dims.decode, grad=needs_grad(q, k, v, g, beta, initial_state),
                 kda=is_kda)
    if library.compiling():  # traced by torch.compile: one opaque node (gdn.ops.library)
        return library.recurrent(op, impl, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    return (kda if is_kda else delta).run(impl, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)


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
    return _recurrent_call("kimi_delta_attention", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, backend)


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
    if cu_seqlens is not None and library.compiling():  # the host loop over sequences: one opaque node
        return _attention.packed_op(q, k, v, None if scale is None else float(scale), bool(causal), window_size,
                                    cu_seqlens, backend == "naive", library.autocast_of(q))
    fn = _attention.softmax_attention_naive if backend == "naive" else _attention.softmax_attention
    return fn(q, k, v, scale=scale, causal=causal, window_size=window_size, cu_seqlens=cu_seqlens)
