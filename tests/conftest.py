"""Test-session setup that must happen before anything imports triton.

On a machine without an NVIDIA GPU the Triton kernels run through Triton's interpreter. The
variable must be set before the first ``import triton`` anywhere (``import gdn`` pulls in
transformers, which may import triton), so it is set here, at collection start.
"""
from __future__ import annotations

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
