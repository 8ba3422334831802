"""Gated DeltaNet from the layer's raw inputs: the prologue (L2-norm of q and k, β, g) and the op
as one entry point.

    o, S = gated_delta_rule_fused(q, k, v, a, b, A_log, dt_bias, *, scale=None, initial_state=None,
                                  output_final_state=False, cu_seqlens=None, use_qk_l2norm=True,
                                  allow_neg_eigval=False, backend=None)

computes ``q̂ = q·rsqrt(Σq² + eps)`` (and k̂), ``g = −exp(A_log)·softplus(a + dt_bias)`` and
``β = sigmoid(b)`` (``2·sigmoid(b)`` with ``allow_neg_eigval``) as :mod:`gdn.ops.gates` defines
them, then the gated delta rule on the implementation :mod:`gdn.ops.router` picks. On Triton the
prologue runs in its own kernels with their backward (:mod:`.triton.prologue`); elsewhere in
PyTorch (autograd).

Under ``torch.compile`` the whole call (prologue and recurrence) is the custom op
``gdn::gated_delta_rule_fused``, whose backward recomputes it (:mod:`gdn.ops.library`).
"""
from __future__ import annotations

import torch

from .. import gates, library
from ..checks import check_backend, check_recurrent
from ..router import CHUNK, HAS_TRITON, NAIVE, needs_grad, route
from . import run

if HAS_TRITON:
    from .triton.prologue import prologue

__all__ = ["gated_delta_rule_fused", "run_fused"]


def _check_params(a, b, A_log, dt_bias):
    if not isinstance(b, torch.Tensor) or b.shape != a.shape:
        raise ValueError(f"b must have the shape of a [B, T, HV] = {list(a.shape)}, got "
                         f"{list(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
    HV = a.shape[-1]
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape [HV] = [{HV}], got {type(x).__name__}")
        if tuple(x.shape) != (HV,):
            raise ValueError(f"{name} must have shape [HV] = [{HV}], got {list(x.shape)}")
        if x.device != a.device:
            raise ValueError(f"{name} is on {x.device} but a is on {a.device}")


def gated_delta_rule_fused(q, k, v, a, b, A_log, dt_bias, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm=True, allow_neg_eigval=False, backend=None):
    """Gated DeltaNet with its prologue fused in.

    Args:
        q, k: [B, T, H, K] queries and keys (normalised here when ``use_qk_l2norm``).
        v: [B, T, HV, V] values; HV a multiple of H.
        a, b: [B, T, HV] pre-activations of the decay and of β.
        A_log, dt_bias: [HV] per-head decay parameters (fp32 math).
        scale, initial_state [N, HV, K, V], output_final_state, cu_seqlens [N + 1]: as in
            :func:`gdn.ops.gated_delta_rule`.
        use_qk_l2norm: L2-normalise q and k over K (eps :data:`gdn.ops.gates.L2NORM_EPS`).
        allow_neg_eigval: β = 2·sigmoid(b) (transition eigenvalues in [−1, 1]).
        backend: ``None`` (the router's pick) or ``"triton"``, ``"chunk"``, ``"naive"``.

    Returns:
        ``(o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] or None)``. Gradients reach q, k,
        v, a, b, A_log, dt_bias and initial_state.
    """
    check_backend(backend)
    dims = check_recurrent(q, k, v, a, None, initial_state, cu_seqlens, scale, backend, name_g="a")
    _check_params(a, b, A_log, dt_bias)
    grad = needs_grad(q, k, v, a, b, A_log, dt_bias, initial_state)
    impl = route("gated_delta_rule_fused", backend, q, k, v, decode_step=dims.decode, grad=grad)
    if library.compiling():  # traced by torch.compile: one opaque node
        fn = _fused_op if cu_seqlens is None else _fused_packed_op
        o, S = fn(impl, q, k, v, a, b, A_log, dt_bias, None if scale is None else float(scale), initial_state,
                  bool(output_final_state), cu_seqlens, bool(use_qk_l2norm), bool(allow_neg_eigval),
                  library.autocast_of(q))
        return o, library.none_if_empty(S, output_final_state)
    return run_fused(impl, q, k, v, a, b, A_log, dt_bias, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                     allow_neg_eigval=allow_neg_eigval)


def run_fused(impl, q, k, v, a, b, A_log, dt_bias, *, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, use_qk_l2norm=True, allow_neg_eigval=False):
    """:func:`gated_delta_rule_fused` on implementation ``impl`` (validated arguments): the prologue
    in PyTorch for ``"naive"`` and ``"chunk"``, in Triton kernels otherwise."""
    if impl in (NAIVE, CHUNK):
        g, beta = gates.scalar_decay(a, A_log, dt_bias), gates.write_strength(b, allow_neg_eigval)
        if use_qk_l2norm:
            q, k = gates.l2_normalise(q), gates.l2_normalise(k)
    else:
        q, k, g, beta = prologue(q, k, a, b, A_log, dt_bias, use_qk_l2norm, allow_neg_eigval)
    return run(impl, q, k, v, g, beta, scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens)


# ---- the custom op (torch.compile) --------------------------------------------------------------

def _fused_run(impl, q, k, v, a, b, A_log, dt_bias, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm, allow_neg_eigval, autocast):
    with library.autocast_as(q.device.type, autocast):
        o, S = run_fused(impl, q, k, v, a, b, A_log, dt_bias, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
                         allow_neg_eigval=allow_neg_eigval)
    return o.contiguous(), (S.contiguous() if S is not None else v.new_empty(0, dtype=library.state_dtype(impl, v)))


def _fused_fake(impl, q, k, v, a, b, A_log, dt_bias, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm, allow_neg_eigval, autocast):
    return library.recurrent_fake(impl, q, k, v, None, None, scale, initial_state, output_final_state, cu_seqlens,
                                  autocast)


#: the fused op for calls without cu_seqlens and for packed calls (library.op_pair)
_fused_op, _fused_packed_op = library.op_pair(
    "gated_delta_rule_fused",
    "str impl, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, float? scale, "
    "Tensor? initial_state, bool output_final_state, Tensor? cu_seqlens, bool use_qk_l2norm, "
    "bool allow_neg_eigval, ScalarType? autocast",
    2, _fused_run, _fused_fake, differentiable=(1, 2, 3, 4, 5, 6, 7, 9))
