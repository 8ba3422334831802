"""gdn: Gated DeltaNet and the linear-attention family, from the math to kernels and models."""
from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # noqa: E402,F401
