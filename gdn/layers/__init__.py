"""Layers: the token mixers as ``nn.Module`` s (one per file) and the shared blocks.

Every mixer maps ``x`` [B, T, D] to ``(o [B, T, D], state)``: it runs whole sequences (chunked
ops) and continues from a state one or a few tokens at a time (the recurrence), with the same
numbers. Padding (``attention_mask``, left padding for generation) and packing (``cu_seqlens``)
never let one sequence's tokens reach another's state.
"""
from __future__ import annotations

from .attention import Attention, rotary
from .conv import ShortConvolution
from .deltanet import DeltaNet
from .gated_deltanet import GatedDeltaNet, gated_delta_core
from .gated_linear_attention import GatedLinearAttention
from .linear_attention import LinearAttention
from .mlp import SwiGLU
from .norm import GatedRMSNorm, RMSNorm
from .state import KVState, RecurrentState

__all__ = [
    "Attention",
    "DeltaNet",
    "GatedDeltaNet",
    "GatedLinearAttention",
    "GatedRMSNorm",
    "KVState",
    "LinearAttention",
    "RMSNorm",
    "RecurrentState",
    "ShortConvolution",
    "SwiGLU",
    "gated_delta_core",
    "rotary",
]
