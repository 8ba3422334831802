"""The warp-specialised reverse pass of the gated delta rule's backward
(gdn.ops.delta.triton.fused_rev, ``DELTA["fused_rev"]``) on the GPU: the cases of test_chunk.py it
takes (K and V of 64 or 128 after padding) and cases of value heads of 256 (two 128-wide value
tiles a head: V = 256 and 200 padded, K = 128 and 64, grouped and packed heads, the 340m layer),
bf16 and fp16, against the float64 reference at tier 3, the pass run whole, slice by slice (one
chunk a slice, the carried dS read and written in place), as warm-started segments, or as
warm-started segments slice by slice (the first slice warm-started, carrying its dS out to the
later ones), each on value tiles of 128 and of 64 columns; and the
launches show it replaced dv_local and state_bwd. Gluon has no interpreter, so this is its only
check of results."""
from __future__ import annotations

import pytest
import torch

from gdn.ops import tuning
from gdn.ops.delta.triton import chunk_bwd, fused_rev
from gdn.ops.delta.triton import split as split_mod

from .helpers import assert_within, dtype_id, launched, poison_empty
from .test_chunk import check_once
from .test_fused_fwd import CASES  # the warp-specialised forward's cases: the shapes both passes take


@pytest.mark.parametrize("mode", ("whole", "chunk-slices", "segments-of-2", "segments-of-3-chunk-slices",
                                  "whole-tiles-64", "chunk-slices-tiles-64", "segments-of-2-tiles-64",
                                  "segments-of-3-chunk-slices-tiles-64"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=dtype_id)
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in CASES])
def test_fused_reverse(case, dtype, mode, monkeypatch):
    """Whole sequences; one chunk a slice; warm-started segments of two chunks (each program
    first walks its warm-up chunks after the segment: split.warm_plan's ``after`` walk); or
    segments of three chunks run one chunk a slice, tails first (the first slice's programs warm
    up and store the dS entering them, the later ones start from it); each on
    128-wide value tiles (``narrow`` off) or on tiles of 64 (``VT``: what plain_tile picks for an
    unsplit pass that would leave half the card idle). Fresh
    buffers hold NaN (``poison_empty``): sliced, the per-chunk kernel meets rows of dδ that a later
    slice writes."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMAs: compute capability 9")
    VT = 64 if mode.endswith("tiles-64") else 128
    monkeypatch.setitem(tuning.DELTA, "fused_rev", dict(tuning.DELTA["fused_rev"], on=True, VT=VT, narrow=0))
    split = int(mode.split("-")[2]) if mode.startswith("segments-of-") else 0
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], warm=bool(split), L=split))
    # slice_MB: 0 never slices; a budget below one chunk's dS (no cap) makes every chunk a slice
    sliced = "chunk-slices" in mode
    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], max_slices=10 ** 9,
                                                        slice_MB=1e-9 if sliced else 0))
    seen = launched(monkeypatch, fused_rev, chunk_bwd, split_mod)
    poison_empty(monkeypatch)
    errs, bounds = check_once(case, "gated_delta_rule", 3400 + CASES.index(case), dtype)
    assert "fused_rev_kernel" in seen and "state_bwd_kernel" not in seen and "dv_local_kernel" not in seen, seen
    longest = max(case[7] or [case[2]])
    if sliced and longest > 64:  # a sequence of more than one chunk: several slices
        assert seen.count("fused_rev_kernel") > 1, seen
    if split and longest > split * 64:  # a sequence of more than one segment's chunks: segments
        assert "warm_plan_kernel" in seen, seen
    assert_within(errs, bounds, f"warp-specialised reverse pass at {case[0]}, {dtype_id(dtype)}, {mode}")
