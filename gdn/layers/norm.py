"""Normalisation blocks: RMSNorm and the output-gated RMSNorm of the recurrent mixers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32: ``x / rms(x) · weight``.

    Args:
        dim: size D of the normalised (last) dimension.
        eps: added to the mean square before the square root.

    Shapes: ``x`` [..., D] -> [..., D] in ``x.dtype``.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight._no_weight_decay = True

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> [..., D]."""
        return self._normalise(x).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(RMSNorm):
    """RMSNorm of ``x`` times ``SiLU(gate)``: the output block of Gated DeltaNet (per head).

    Shapes: ``x``, ``gate`` [..., D] -> [..., D] in ``x.dtype`` (fp32 inside).
    """

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x, gate: [..., D] -> [..., D]."""
        if gate.shape != x.shape:
            raise ValueError(f"gate must have the shape of x {tuple(x.shape)}, got {tuple(gate.shape)}")
        return (self._normalise(x) * F.silu(gate.float())).to(x.dtype)
