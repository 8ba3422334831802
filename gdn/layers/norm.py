"""Normalisation blocks: RMSNorm and the output-gated RMSNorm of the recurrent mixers (the ops:
:mod:`gdn.ops.norm`)."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.gemv import norm_linear
from ..ops.library import autocast_of
from ..ops.norm import add_rms_norm, gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32: ``x / rms(x) · weight``.

    Args:
        dim: size D of the normalised (last) dimension.
        eps: added to the mean square before the square root.

    Shapes: ``x`` [..., D] -> [..., D] in ``x.dtype``, or in the autocast dtype when autocast is on
    for ``x``'s device (its consumers are the projections, which would cast it anyway; one
    low-precision copy is then shared by all of them instead of one per projection).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight._no_weight_decay = True

    def _check(self, name: str, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [..., {self.weight.shape[0]}], got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"{name} must have shape [..., {self.weight.shape[0]}], got {tuple(x.shape)}")

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> ``x · rstd · weight`` [..., D] in fp32, through plain autograd (for a caller
        that goes on combining it in fp32, as the KDA output gate does)."""
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., D] -> [..., D]. With ``residual`` h [..., D]: a residual add and this norm after it,
        ``(s, norm(s))`` with ``s = x + h``, one kernel each way where the norm's kernels run
        (:func:`gdn.ops.norm.add_rms_norm`); inside the module's call, so its hooks see it."""
        self._check("x", x)
        if residual is None:
            return rms_norm(x, self.weight, self.eps, autocast_of(x) or x.dtype)
        self._check("residual", residual)
        dt = autocast_of(x) or torch.promote_types(x.dtype, residual.dtype)
        return add_rms_norm(x, residual, self.weight, self.eps, dt)

    def add_forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(x, residual=h)``: ``(s, norm(s))`` with ``s = x + h``. x, h: [..., D]."""
        return self(x, residual=h)

    def linear_forward(self, x: torch.Tensor, delta: torch.Tensor | None,
                       weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add, this norm and the projection that reads it: ``(s, F.linear(self(s),
        weight))`` with ``s = x + delta`` (x when delta is None); one kernel at decode for up to four
        rows (:func:`gdn.ops.gemv.norm_linear`). x, delta: [..., D]; weight [N, D]."""
        self._check("x", x)
        dt = autocast_of(x) or (x.dtype if delta is None else torch.promote_types(x.dtype, delta.dtype))
        return norm_linear(x, delta, self.weight, self.eps, weight, dt)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(RMSNorm):
    """RMSNorm of ``x`` times ``SiLU(gate)``: the output block of Gated DeltaNet (per head).

    Shapes: ``x``, ``gate`` [..., D] -> [..., D] in ``x.dtype`` (fp32 inside).
    """

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x, gate: [..., D] -> [..., D]."""
        self._check("x", x)
        if not isinstance(gate, torch.Tensor) or gate.shape != x.shape:
            raise ValueError(f"gate must have the shape of x {tuple(x.shape)}, got "
                             f"{tuple(gate.shape) if isinstance(gate, torch.Tensor) else type(gate).__name__}")
        return gated_rms_norm(x, gate, self.weight, self.eps)
