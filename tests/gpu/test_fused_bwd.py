"""The Gluon fused backward of the gated delta rule (``DELTA["fused_bwd"]``, gdn.ops.delta.triton.
fused_bwd) on the GPU: the cases of test_chunk.py that it takes (K of 32-128 after padding, V a
multiple of its value tile), bf16 and fp16, against the float64 reference at tier 3; and the
launches show it replaced dqk and wy_bwd. Gluon has no interpreter, so this is its only check of
results."""
from __future__ import annotations

import pytest
import torch

from gdn.ops import tuning
from gdn.ops.delta.triton import chunk_bwd

from .helpers import assert_within, dtype_id
from .test_chunk import AWKWARD, BENCH, check_case, reference

CASES = [c for c in AWKWARD if max(32, c[5]) <= 128] + [BENCH[0], BENCH[3]]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=dtype_id)
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in CASES])
def test_fused_backward(case, dtype, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMAs: compute capability 9")
    monkeypatch.setitem(tuning.DELTA, "fused_bwd", dict(tuning.DELTA["fused_bwd"], on=True))
    seen = []
    run = chunk_bwd.launch

    def spy(kernel, grid, *args, **meta):
        seen.append(kernel.fn.__name__)
        return run(kernel, grid, *args, **meta)

    monkeypatch.setattr(chunk_bwd.fused_bwd, "launch", spy)
    monkeypatch.setattr(chunk_bwd, "launch", spy)
    try:
        errs, bounds = check_case(case, "gated_delta_rule", 3000 + CASES.index(case), dtype)
    finally:
        reference.cache_clear()
    assert "fused_bwd_kernel" in seen and "dqk_kernel" not in seen and "wy_bwd_kernel" not in seen, seen
    assert_within(errs, bounds, f"fused backward at {case[0]}, {dtype_id(dtype)}")
