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
from .gated_deltanet import GatedDeltaNet
from .gated_linear_attention import GatedLinearAttention
from .kda import KimiDeltaAttention
from .linear_attention import LinearAttention
from .mlp import SwiGLU
from .norm import GatedRMSNorm, RMSNorm
from .recurrent import RecurrentMixer, mamba_gate_init
from .state import KVState, RecurrentState

__all__ = [
    "Attention",
    "DeltaNet",
    "GatedDeltaNet",
    "GatedLinearAttention",
    "GatedRMSNorm",
    "KimiDeltaAttention",
    "KVState",
    "LinearAttention",
    "RMSNorm",
    "RecurrentMixer",
    "RecurrentState",
    "ShortConvolution",
    "SwiGLU",
    "mamba_gate_init",
    "rotary",
]
