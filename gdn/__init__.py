"""gdn: Gated DeltaNet and the linear-attention family, from the math to kernels and models.

``import gdn`` registers the ``gdn`` model type with transformers' ``AutoConfig``, ``AutoModel``
and ``AutoModelForCausalLM`` (it imports :mod:`gdn.ops` and :mod:`gdn.models`). The ``gdn``
command is the exception: each subcommand imports what it needs, so ``gdn --help`` and
``gdn --version`` answer without loading torch.
"""
from __future__ import annotations

import os
import sys

__version__ = "0.1.0"


def _running_the_gdn_command() -> bool:
    return os.path.basename(sys.argv[0]) in ("gdn", "gdn.exe") if sys.argv and sys.argv[0] else False


if not _running_the_gdn_command():
    from . import ops  # noqa: E402,F401
    from . import models  # noqa: E402,F401  (registers the HF auto classes)
