"""Triton kernels of the scalar-gate family: chunk kernels (:mod:`.chunk`, with autograd), the
token-recurrent kernel (:mod:`.recurrent`, inference), the serving kernels on a state pool
(:mod:`.pool`) and the fused prologue (:mod:`.prologue`).

:func:`run_chunk` and :func:`run_recurrent` run one member (``g`` / ``beta`` None for what it lacks)
on validated arguments, with the contract of :func:`gdn.ops.gated_delta_rule`::

    q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state [N, HV, K, V];
    cu_seqlens [N + 1] -> (o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] fp32 or None)

Which of the two runs a call is :mod:`gdn.ops.router`'s decision. Under torch.compile the public
ops reach them through the custom ops of :mod:`gdn.ops.library` (opaque calls with fake
implementations); called directly, they are excluded from tracing (dynamo cannot trace their
launch helpers, and there is nothing for it to fuse inside them).
"""
from __future__ import annotations

import torch

from .chunk import chunk_op
from .recurrent import fused_recurrent_gated_delta_rule

__all__ = ["run_chunk", "run_recurrent", "chunk_op", "fused_recurrent_gated_delta_rule"]


@torch.compiler.disable
def run_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """One member on the chunk kernels (autograd)."""
    return chunk_op(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens)


@torch.compiler.disable
def run_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """One member on the token-recurrent kernel (no gradient)."""
    return fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state, cu_seqlens=cu_seqlens)
