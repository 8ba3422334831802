"""SwiGLU feed-forward block."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.library import autocast_of
from ..ops.swiglu import swiglu_down


class SwiGLU(nn.Module):
    """``down(SiLU(gate(x)) · up(x))``, no biases.

    The activation, the product and ``down`` run as one autograd Function that keeps only the
    outputs of ``gate`` and ``up`` for the backward (so ``down_proj`` is a plain weight holder:
    module hooks on it do not fire).

    Args:
        hidden_size: model width D.
        intermediate_size: inner width I.

    Shapes: ``x`` [B, T, D] -> [B, T, D] (in the autocast dtype under autocast).
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        for name, val in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D]."""
        gate, up = self.gate_proj(x), self.up_proj(x)
        dtype = autocast_of(gate) or gate.dtype
        return swiglu_down(gate, up, self.down_proj.weight, dtype)
