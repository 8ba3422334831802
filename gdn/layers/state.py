"""Per-layer decoding state: what a mixer carries from one call to the next.

A recurrent mixer keeps its short-convolution tails and the fp32 matrix state; an attention
layer keeps its keys and values (all of them, or the last ``window − 1`` for a sliding window).
The model's cache (:class:`gdn.models.GDNCache`) holds one of these per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class RecurrentState:
    """State of a recurrent mixer.

    conv: the short-convolution states of q, k, v, each [B, D, K-1] (empty tuple without short convs).
    recurrent: [B, HV, K, V] fp32 matrix state.
    tails: the static cache's layout (None elsewhere): one buffer [B, ΣD, K-1] whose channel slices,
        q, k, v in order, are ``conv``, so that its decode step runs the three convolutions as one.
    """

    conv: tuple[torch.Tensor, ...]
    recurrent: torch.Tensor
    tails: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes held (constant in the sequence length)."""
        return _nbytes(*self.conv, self.recurrent)

    def index_select(self, index: torch.Tensor) -> "RecurrentState":
        """Keep batch rows ``index`` [B'] (beam reordering, dropping finished rows)."""
        return RecurrentState(tuple(c.index_select(0, index) for c in self.conv), self.recurrent.index_select(0, index))


@dataclass
class KVState:
    """State of a softmax-attention layer.

    key: [B, Tc, HKV, D] and value: [B, Tc, HKV, Dv] cached after RoPE; valid: [B, Tc] bool
    (False for padding). ``window``: None (global, Tc grows) or W (Tc ≤ W − 1). ``seen``: slots
    (tokens, padding included) processed so far, which a window's Tc no longer tells.
    """

    key: torch.Tensor
    value: torch.Tensor
    valid: torch.Tensor
    window: int | None
    seen: int

    def nbytes(self) -> int:
        """Bytes held (grows with the sequence for global attention, bounded for a window)."""
        return _nbytes(self.key, self.value, self.valid)

    def index_select(self, index: torch.Tensor) -> "KVState":
        """Keep batch rows ``index`` [B']."""
        return KVState(self.key.index_select(0, index), self.value.index_select(0, index),
                       self.valid.index_select(0, index), self.window, self.seen)
