"""One decode step of the scalar-gate family with the state updated in place.

    o = recurrent_step_(q, k, v, g, beta, state, *, scale=None, backend=None)
    o = gated_delta_rule_fused_step_(q, k, v, a, b, A_log, dt_bias, state, *, scale=None,
                                     use_qk_l2norm=True, allow_neg_eigval=False, backend=None)

Every row is one token (q [B, 1, H, K]) continuing from its state ``state`` [B, HV, K, V], which
holds the state after the token when the call returns; its storage never changes (what a captured
decode step needs). The numbers are those of :func:`gdn.ops.gated_delta_rule` (and the other
members, ``g`` / ``beta`` None for what they lack) and :func:`gdn.ops.gated_delta_rule_fused` with
``initial_state=state, output_final_state=True``, on the implementation the router picks for that
call. When it picks the token-recurrent kernel, the kernel reads the state and writes it back in
place (:func:`gdn.ops.delta.triton.pool.fused_recurrent_step_`), so ``state`` must then be float32
and contiguous; every other implementation returns a new state, which is copied into ``state``.
Inference only (no autograd through the in-place write).
"""
from __future__ import annotations

import torch

from ..checks import check_backend, check_recurrent, shape_str
from ..router import HAS_TRITON, TRITON_RECURRENT, needs_grad, route
from . import run
from .fused import _check_params, run_fused

if HAS_TRITON:
    from .triton.pool import fused_gated_delta_rule_step_, fused_recurrent_step_

__all__ = ["recurrent_step_", "gated_delta_rule_fused_step_"]


def _check_step(op, q, k, v, g, beta, state, scale, backend, name_g="g"):
    check_backend(backend)
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"state must be a torch.Tensor [B, HV, K, V], got {type(state).__name__}")
    dims = check_recurrent(q, k, v, g, beta, state, None, scale, backend, name_g=name_g)
    if dims.T != 1:
        raise ValueError(f"{op} takes one token per row: q must have shape [B, 1, H, K], got {shape_str(q)}")
    if needs_grad(q, k, v, g, beta, state):
        raise ValueError(f"{op} updates the state in place and has no backward: call it under torch.no_grad()")


def _kernel_state(op, state):
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"{op} on the token-recurrent kernel updates a float32 contiguous state in place, got "
                         f"{state.dtype} with strides {state.stride()}")
    return state


def recurrent_step_(q, k, v, g, beta, state, *, scale=None, backend=None):
    """One token per row of a scalar-gate member (``g`` [B, 1, HV] / ``beta`` [B, 1, HV] None where it
    lacks them), ``state`` [B, HV, K, V] updated in place. Returns o [B, 1, HV, V] in v.dtype."""
    _check_step("recurrent_step_", q, k, v, g, beta, state, scale, backend)
    impl = route("recurrent_step_", backend, q, k, v, decode_step=True, grad=False)
    if impl == TRITON_RECURRENT:
        return fused_recurrent_step_(q, k, v, g, beta, _kernel_state("recurrent_step_", state), scale=scale)
    o, S = run(impl, q, k, v, g, beta, scale=scale, initial_state=state, output_final_state=True)
    state.copy_(S)
    return o


def gated_delta_rule_fused_step_(q, k, v, a, b, A_log, dt_bias, state, *, scale=None, use_qk_l2norm=True,
                                 allow_neg_eigval=False, backend=None):
    """:func:`gdn.ops.gated_delta_rule_fused` for one token per row, ``state`` [B, HV, K, V] updated in
    place: a, b [B, 1, HV] the raw pre-activations of the decay and of β; A_log, dt_bias [HV]. The
    prologue (L2 norms, g, β) is the one of the fused op on the same implementation. Returns
    o [B, 1, HV, V] in v.dtype.

    On the token-recurrent kernel the prologue runs inside it
    (:func:`gdn.ops.delta.triton.pool.fused_gated_delta_rule_step_`): one launch, the same g and β,
    and q̂, k̂ not rounded to q's dtype before the step (in bf16 the output moves by about one bf16
    rounding of q̂, k̂ against the prologue kernels' path; in fp32 by a few ulp)."""
    _check_step("gated_delta_rule_fused_step_", q, k, v, a, None, state, scale, backend, name_g="a")
    _check_params(a, b, A_log, dt_bias)
    if needs_grad(a, b, A_log, dt_bias):
        raise ValueError("gated_delta_rule_fused_step_ updates the state in place and has no backward: call it "
                         "under torch.no_grad()")
    impl = route("gated_delta_rule_fused_step_", backend, q, k, v, decode_step=True, grad=False)
    if impl == TRITON_RECURRENT:
        return fused_gated_delta_rule_step_(q, k, v, a, b, A_log, dt_bias,
                                            _kernel_state("gated_delta_rule_fused_step_", state), scale=scale,
                                            use_qk_l2norm=use_qk_l2norm, allow_neg_eigval=allow_neg_eigval)
    o, S = run_fused(impl, q, k, v, a, b, A_log, dt_bias, scale=scale, initial_state=state, output_final_state=True,
                     use_qk_l2norm=use_qk_l2norm, allow_neg_eigval=allow_neg_eigval)
    state.copy_(S)
    return o
