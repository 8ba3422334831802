"""The Gluon forward pass of the gated delta rule (``DELTA["fused_fwd"]``, gdn.ops.delta.triton.
fused_fwd) on the GPU, forced on (it is off by default): the cases of test_chunk.py it takes (K of
64 or 128 after padding, V a multiple of its value tile), bf16 and fp16, against the float64
reference at tier 3 (forward and backward: the backward recomputes its states itself); and the
launches show it replaced state_out. Gluon has no interpreter, so this is its only check of results."""
from __future__ import annotations

import pytest
import torch

from gdn.ops import tuning
from gdn.ops.delta.triton import chunk_fwd, fused_fwd

from .helpers import assert_within, dtype_id, launched
from .test_chunk import AWKWARD, BENCH, check_once

CASES = ([c for c in AWKWARD if max(32, 1 << (c[5] - 1).bit_length()) in (64, 128)
          and (1 << (c[6] - 1).bit_length()) % 64 == 0] + [BENCH[0], BENCH[3]])


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=dtype_id)
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in CASES])
def test_fused_forward(case, dtype, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMAs: compute capability 9")
    monkeypatch.setitem(tuning.DELTA, "fused_fwd", dict(tuning.DELTA["fused_fwd"], on=True))
    # the fused pass (which the Gluon one replaces) at every case, and no warm-started split
    monkeypatch.setitem(tuning.DELTA, "state_out", dict(tuning.DELTA["state_out"], fill=0))
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], warm=False))
    seen = launched(monkeypatch, fused_fwd, chunk_fwd)
    errs, bounds = check_once(case, "gated_delta_rule", 3300 + CASES.index(case), dtype)
    assert "fused_fwd_kernel" in seen and "state_out_kernel" not in seen, seen
    assert_within(errs, bounds, f"Gluon forward pass at {case[0]}, {dtype_id(dtype)}")
