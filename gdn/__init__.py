"""gdn: Gated DeltaNet and the linear-attention family, from the math to kernels and models.

``import gdn`` registers the ``gdn`` model type with transformers' ``AutoConfig``, ``AutoModel``
and ``AutoModelForCausalLM``.
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import ops  # noqa: E402,F401
from . import models  # noqa: E402,F401  (registers the HF auto classes)
