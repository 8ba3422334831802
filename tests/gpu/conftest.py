"""GPU tests: the Triton kernels on a CUDA device against float64 references (tier 3 of
docs/DESIGN.md §6). Without a CUDA device every test in this folder is collected and skipped.

``GDN_TUNING`` (a JSON file or inline JSON, read by :func:`gdn.ops.tuning.update_from`) runs the
tests under launch-setting overrides, e.g. a ``tools/tune_gpu.py --out`` file or
``GDN_TUNING='{"split": {"L": 2, "warm": false}}'`` for the chained split state passes.
"""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Skip every item of this folder when there is no CUDA device (the hook sees every collected
    item, so it picks this folder's by path)."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU tests of the Triton kernels)")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


def pytest_report_header(config):
    if not HAS_CUDA:
        return "tests/gpu: no CUDA device, skipped"
    import triton

    tuning = os.environ.get("GDN_TUNING")
    return (f"tests/gpu: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
            + (f", GDN_TUNING={tuning}" if tuning else ""))


@pytest.fixture(autouse=True, scope="session")
def _tuning_overrides():
    """Apply ``GDN_TUNING`` before the first GPU test of each worker: the launch tables are module
    state of the worker's process, so one update covers every test it runs."""
    if os.environ.get("GDN_TUNING"):
        from gdn.ops import tuning

        tuning.update_from(os.environ["GDN_TUNING"])
    yield


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Give the memory a test cached back to the device after it: several pytest workers share one
    GPU (``-n``), and a worker's allocator would otherwise keep its largest case's blocks."""
    yield
    gc.collect()
    torch.cuda.empty_cache()
