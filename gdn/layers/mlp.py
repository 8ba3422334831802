"""SwiGLU feed-forward block."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``down(SiLU(gate(x)) · up(x))``, no biases.

    Args:
        hidden_size: model width D.
        intermediate_size: inner width I.

    Shapes: ``x`` [B, T, D] -> [B, T, D].
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
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
