"""SwiGLU feed-forward block."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.gemv import decode_linear
from ..ops.library import autocast_of
from ..ops.swiglu import swiglu_down, swiglu_down_joined
from .fused import FusedLinear, joinable, joined_weight


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
        """x: [B, T, D] -> [B, T, D]. Where gate and up are plain bias-free ``nn.Linear`` layers that
        no hook watches: one product with their weights joined (x read once, and the backward's dx
        one product instead of a sum of two), whose gradient the SwiGLU's backward writes whole."""
        if not joinable((self.gate_proj, self.up_proj)):
            return self._down(self.gate_proj(x), self.up_proj(x))
        gu = F.linear(x, joined_weight([self.gate_proj.weight, self.up_proj.weight], autocast_of(x)))
        return swiglu_down_joined(gu, self.down_proj.weight, autocast_of(gu) or gu.dtype)

    def decode_weights(self) -> FusedLinear:
        """``gate_proj`` and ``up_proj`` as one weight, for :meth:`decode`."""
        return FusedLinear({"gate_proj": self.gate_proj, "up_proj": self.up_proj})

    def decode(self, x: torch.Tensor, weights: FusedLinear) -> torch.Tensor:
        """:meth:`forward` with gate and up from one GEMM (``weights``: :meth:`decode_weights`)."""
        return self.decode_from(decode_linear(x, weights.weight), weights)

    def decode_from(self, y: torch.Tensor, weights: FusedLinear) -> torch.Tensor:
        """:meth:`decode` from the joined gate and up projection ``y`` [..., 2 I]: the down projection
        of SiLU(gate) · up."""
        p = weights.split(y)
        gate = p["gate_proj"]
        return decode_linear(gate, self.down_proj.weight, p["up_proj"], autocast_of(gate) or gate.dtype)

    def _down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu_down(gate, up, self.down_proj.weight, autocast_of(gate) or gate.dtype)
