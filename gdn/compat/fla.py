"""FLA-compatible entry points backed by gdn's backends.

Code written against flash-linear-attention (FLA) runs on gdn by changing its import::

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from gdn.compat.fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule   # instead

The functions take FLA's arguments in FLA's order (``q, k, v, g, beta, scale, initial_state,
output_final_state, use_qk_l2norm_in_kernel, …, cu_seqlens``) and return what FLA returns:
``(o [B, T, HV, V] in q.dtype, final state [N, HV, K, V] fp32 or None)``. Keyword arguments FLA
accepts but that only tune its kernels (``chunk_size``, ``cu_seqlens_cpu``, ``chunk_indices``,
``safe_gate``, ``use_graph``, …) are accepted and do not change the result; unknown keywords are
ignored as FLA ignores them (transformers forwards its own keyword arguments to these calls).

``transformers``' Qwen3-Next, Qwen3.5 (dense and MoE) and Kimi Linear layers look these functions
up by module-level name at call time; the one-line switch that makes them run on gdn is::

    gdn.compat.fla.patch_transformers()

which rebinds those names (``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``,
``chunk_kimi_delta_attention``, ``recurrent_kimi_delta_attention``) in the modeling modules. It
returns a :class:`TransformersPatch` that undoes the switch (``.undo()`` or ``with`` block).
"""
from __future__ import annotations

import importlib
import logging

import torch

from .. import ops
from ..ops import gates

logger = logging.getLogger(__name__)

__all__ = [
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "chunk_kda",
    "fused_recurrent_kda",
    "l2norm",
    "patch_transformers",
    "TransformersPatch",
]

#: Keyword arguments of FLA's functions that select kernel variants or precomputed helpers only.
_KERNEL_HINTS = {"chunk_size", "cu_seqlens_cpu", "chunk_indices", "safe_gate", "use_graph", "max_num_seqs",
                 "disable_recompute", "inplace_final_state"}


def l2norm(x: torch.Tensor, eps: float = gates.L2NORM_EPS) -> torch.Tensor:
    """FLA's L2 normalisation ``x / sqrt(Σ x² + eps)`` over the last dim, in fp32, back in x.dtype
    (:func:`gdn.ops.gates.l2_normalise`). [..., D] -> [..., D]."""
    return gates.l2_normalise(x, eps)


def _check_hints(name: str, kwargs: dict) -> None:
    if kwargs.get("cp_context") is not None:
        raise ValueError(f"{name}: cp_context (context parallelism) is not supported by gdn; pass cp_context=None")
    if kwargs.get("return_intermediate_states"):
        raise ValueError(f"{name}: return_intermediate_states=True is not supported by gdn")
    if "head_first" in kwargs:
        raise ValueError(f"{name}: head_first was removed from FLA; give inputs as [B, T, H, D]")
    cs = kwargs.get("chunk_size")
    if cs is not None and (isinstance(cs, bool) or not isinstance(cs, int) or cs < 1):
        raise ValueError(f"{name}: chunk_size must be a positive int, got {cs!r}")
    ignored = sorted(set(kwargs) - _KERNEL_HINTS - {"cp_context", "return_intermediate_states"})
    if ignored:
        logger.debug("%s: ignoring keyword arguments %s (FLA ignores them too)", name, ignored)


def _beta(beta, q, HV, use_sigmoid: bool, allow_neg_eigval: bool, name: str):
    if allow_neg_eigval and not use_sigmoid:
        raise ValueError(f"{name}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if beta is None:
        return torch.ones(*q.shape[:2], HV, dtype=q.dtype, device=q.device)
    if use_sigmoid:
        beta = gates.write_strength(beta, allow_neg_eigval)
    return beta


def _state_in(initial_state, state_v_first: bool):
    if initial_state is None or not state_v_first:
        return initial_state
    return initial_state.transpose(-1, -2)


def _state_out(S, state_v_first: bool):
    if S is None:
        return None
    S = S.float()
    return S.transpose(-1, -2).contiguous() if state_v_first else S


def _scalar_gate(g, A_log, dt_bias, name: str):
    """FLA's in-kernel scalar gate ``−exp(A_log)·softplus(g + dt_bias)``; g: [B, T, HV]."""
    if A_log is None:
        raise ValueError(f"{name}: use_gate_in_kernel=True needs A_log [HV]")
    return gates.scalar_decay(g, A_log, dt_bias if dt_bias is not None else torch.zeros_like(A_log))


def _gated_delta(name, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, kwargs):
    _check_hints(name, kwargs)
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError(f"{name}: v must be a [B, T, HV, V] tensor")
    if kwargs.get("use_gate_in_kernel"):
        if g is None:
            raise ValueError(f"{name}: use_gate_in_kernel=True needs g (the raw gate input) [B, T, HV]")
        g = _scalar_gate(g, kwargs.get("A_log"), kwargs.get("dt_bias"), name)
    beta = _beta(beta, q, v.shape[2], use_beta_sigmoid_in_kernel, allow_neg_eigval, name)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    S0 = _state_in(initial_state, state_v_first)
    kw = dict(scale=scale, initial_state=S0, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if g is None:
        o, S = ops.delta_rule(q, k, v, beta, **kw)
    else:
        o, S = ops.gated_delta_rule(q, k, v, g, beta, **kw)
    return o.to(q.dtype), _state_out(S, state_v_first)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, **kwargs):
    """FLA's ``chunk_gated_delta_rule``, run by :func:`gdn.ops.gated_delta_rule`.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H); g: [B, T, HV] log decay (or, with
            ``use_gate_in_kernel=True`` and ``A_log``/``dt_bias`` [HV] in kwargs, the raw gate input);
            beta: [B, T, HV] (or logits with ``use_beta_sigmoid_in_kernel``; ``allow_neg_eigval``: 2·sigmoid).
        scale: default ``K ** -0.5``. initial_state: [N, HV, K, V] ([N, HV, V, K] with ``state_v_first``).
        use_qk_l2norm_in_kernel: L2-normalise q and k first (eps 1e-6, fp32).
        cu_seqlens: [N + 1] packed offsets (B == 1). ``cu_seqlens_cpu``/``chunk_indices``: FLA's
            precomputed helpers, accepted and not needed.

    Returns:
        ``(o [B, T, HV, V] in q.dtype, final state fp32 or None)``.
    """
    kwargs.update(cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, cp_context=cp_context)
    if g is None:
        raise ValueError("chunk_gated_delta_rule: g must be a [B, T, HV] tensor, got None")
    return _gated_delta("chunk_gated_delta_rule", q, k, v, g, beta, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                        cu_seqlens, kwargs)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, **kwargs):
    """FLA's ``fused_recurrent_gated_delta_rule``, run by gdn (the recurrence for decode steps).

    Args as :func:`chunk_gated_delta_rule`, with ``g`` optional (None: no decay, DeltaNet), ``beta``
    optional (None: ones), and ``gk`` [B, T, HV, K] an optional per-key-channel log decay (added to
    ``g``; then the call is Kimi Delta Attention). ``gv`` (per-value-channel decay) is not supported.

    Returns:
        ``(o [B, T, HV, V] in q.dtype, final state fp32 or None)``.
    """
    if gv is not None:
        raise ValueError("fused_recurrent_gated_delta_rule: gv (a per-value-channel decay) is not supported by gdn")
    if gk is None:
        kwargs.update(use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias)
        return _gated_delta("fused_recurrent_gated_delta_rule", q, k, v, g, beta, scale, initial_state,
                            output_final_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                            allow_neg_eigval, state_v_first, cu_seqlens, kwargs)
    if use_gate_in_kernel:
        raise ValueError("fused_recurrent_gated_delta_rule: use_gate_in_kernel=True applies to g, not to gk")
    if g is not None:
        gk = gk.float() + g.float()[..., None]
    return fused_recurrent_kda(q, k, v, gk, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                               use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                               allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                               cu_seqlens=cu_seqlens, **kwargs)


def _kda_gate(g, A_log, dt_bias, lower_bound, name):
    """FLA's in-kernel KDA gate. g: [B, T, HV, K]; A_log: [HV] (or None with lower_bound); dt_bias: [HV·K]."""
    HV, K = g.shape[-2], g.shape[-1]
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().view(HV, K)
    if lower_bound is not None:
        if A_log is not None:
            x = torch.exp(A_log.float()).view(HV, 1) * x
        return lower_bound * torch.sigmoid(x)
    if A_log is None:
        raise ValueError(f"{name}: use_gate_in_kernel=True needs A_log [HV] (or a lower_bound)")
    return gates.kda_gate(g, A_log, dt_bias if dt_bias is not None else g.new_zeros(HV * K))


def _kda(name, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
         use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, kwargs):
    _check_hints(name, kwargs)
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError(f"{name}: v must be a [B, T, HV, V] tensor")
    if use_gate_in_kernel:
        g = _kda_gate(g, kwargs.get("A_log"), kwargs.get("dt_bias"), kwargs.get("lower_bound"), name)
    beta = _beta(beta, q, v.shape[2], use_beta_sigmoid_in_kernel, allow_neg_eigval, name)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    S0 = _state_in(initial_state, state_v_first)
    o, S = ops.kimi_delta_attention(q, k, v, g, beta, scale=scale, initial_state=S0,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return o.to(q.dtype), _state_out(S, state_v_first)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    """FLA's ``chunk_kda`` (Kimi Delta Attention), run by gdn's chunkwise KDA.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] per-channel log decay (or, with
            ``use_gate_in_kernel=True``, the raw gate input, with ``A_log`` [HV] and ``dt_bias`` [HV·K]
            in kwargs: ``g = −exp(A_log)·softplus(g + dt_bias)``, or ``lower_bound·sigmoid(exp(A_log)·(g + dt_bias))``
            when ``lower_bound`` is set); beta: [B, T, HV]. Other arguments as :func:`chunk_gated_delta_rule`.

    Returns:
        ``(o [B, T, HV, V] in q.dtype, final state [N, HV, K, V] fp32 or None)``.
    """
    kwargs.update(cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context, lower_bound=lower_bound,
                  return_intermediate_states=return_intermediate_states)
    return _kda("chunk_kda", q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, kwargs)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, **kwargs):
    """FLA's ``fused_recurrent_kda``: Kimi Delta Attention for decoding. Args and returns as :func:`chunk_kda`."""
    kwargs.update(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return _kda("fused_recurrent_kda", q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                state_v_first, cu_seqlens, kwargs)


#: transformers modeling modules and the module-level names their layers call, mapped to gdn's functions.
TRANSFORMERS_TARGETS = {
    "transformers.models.qwen3_next.modeling_qwen3_next": {
        "torch_chunk_gated_delta_rule": chunk_gated_delta_rule,
        "torch_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
    },
    "transformers.models.qwen3_5.modeling_qwen3_5": {
        "torch_chunk_gated_delta_rule": chunk_gated_delta_rule,
        "torch_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
    },
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": {
        "torch_chunk_gated_delta_rule": chunk_gated_delta_rule,
        "torch_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
    },
    "transformers.models.kimi_linear.modeling_kimi_linear": {
        "chunk_kimi_delta_attention": chunk_kda,
        "recurrent_kimi_delta_attention": fused_recurrent_kda,
    },
}


class TransformersPatch:
    """The rebinding done by :func:`patch_transformers`; ``undo()`` restores the originals.
    Usable as a context manager (the switch is undone on exit)."""

    def __init__(self, originals: dict[tuple[str, str], object]):
        self.originals = originals

    @property
    def patched(self) -> list[str]:
        """``module.name`` of every rebound function."""
        return [f"{m}.{n}" for m, n in self.originals]

    def undo(self) -> None:
        """Put transformers' own functions back."""
        for (mod_name, attr), fn in self.originals.items():
            setattr(importlib.import_module(mod_name), attr, fn)
        self.originals = {}

    def __enter__(self) -> "TransformersPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def patch_transformers(models: list[str] | None = None) -> TransformersPatch:
    """Make transformers' Qwen3-Next / Qwen3.5 / Kimi Linear layers call gdn's FLA-compatible functions.

    Args:
        models: short names among ``qwen3_next``, ``qwen3_5``, ``qwen3_5_moe``, ``kimi_linear``
            (default: all those the installed transformers has).

    Returns a :class:`TransformersPatch`. Raises ``ValueError`` for an unknown name, and
    ``RuntimeError`` when a requested module lacks the function names this version expects.
    """
    short = {m.split(".")[2]: m for m in TRANSFORMERS_TARGETS}
    if models is None:
        wanted, required = list(short), False
    else:
        unknown = [m for m in models if m not in short]
        if unknown:
            raise ValueError(f"models: unknown {unknown}; choose among {sorted(short)}")
        wanted, required = list(models), True
    originals = {}
    for name in wanted:
        mod_name = short[name]
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            if required:
                raise
            continue
        targets = TRANSFORMERS_TARGETS[mod_name]
        missing = [a for a in targets if not hasattr(mod, a)]
        if missing:
            raise RuntimeError(f"{mod_name} has no {missing}: this transformers version calls its kernels under "
                               "other names; gdn.compat.fla.TRANSFORMERS_TARGETS needs updating")
        for attr, fn in targets.items():
            originals[(mod_name, attr)] = getattr(mod, attr)
            setattr(mod, attr, fn)
    logger.info("transformers now calls gdn for: %s", ", ".join(f"{m}.{a}" for m, a in originals))
    return TransformersPatch(originals)
