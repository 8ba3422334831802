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


import pytest  # noqa: E402  (after the environment is set)
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    """One intra-op thread per test process: the models are tiny and ``pytest -n 2`` already fills
    the cores (two threads per worker fought for them and ran several times slower)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
