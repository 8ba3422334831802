"""The warp-specialised sequential pass of the gated delta rule (gdn.ops.delta.triton.fused_fwd),
as the forward (``DELTA["fused_fwd"]``) and as the backward's recomputed state pass
(``DELTA["fused_states"]``), on the GPU: the cases of test_chunk.py it takes (K and V of 64 or 128
after padding) and cases of value heads of 256 (two 128-wide value tiles a head: V = 256 and 200
padded, K = 128 and 64, grouped and packed heads, the 340m layer), bf16 and fp16, against the
float64 reference at tier 3 (forward and backward); and the launches show it replaced state_out
or state_fwd. Gluon has no interpreter, so this is its only check of results."""
from __future__ import annotations

import pytest
import torch

from gdn.ops import tuning
from gdn.ops.delta.triton import chunk_fwd, fused_fwd
from gdn.ops.delta.triton import split as split_mod

from .helpers import assert_within, dtype_id, launched
from .test_chunk import AWKWARD, BENCH, check_once


def _width(n: int) -> int:
    return max(32, 1 << (n - 1).bit_length())


#: value heads of 256 (test_chunk.py's case tuples): two value tiles a head; V = 200 padded to 256
#: (the second tile's last columns zero), with an empty and a one-token sequence and grouped heads;
#: the 340m model's layer
WIDE = [
    ("T=300 K=128 V=256", 2, 300, 2, 2, 128, 256, None, True),
    ("packed K=64 V=200", 1, 360, 2, 4, 64, 200, (65, 1, 0, 63, 128, 103), True),
    ("340m layer (4,4096,6,128,256)", 4, 4096, 6, 6, 128, 256, None, True),
]
CASES = ([c for c in AWKWARD if _width(c[5]) in (64, 128) and _width(c[6]) in (64, 128)] + [BENCH[0], BENCH[3]]
         + WIDE)


@pytest.mark.parametrize("VT", (128, 64), ids=("tiles-128", "tiles-64"))
@pytest.mark.parametrize("which", ("fused_fwd", "fused_states"))
@pytest.mark.parametrize("split", (0, 2), ids=("whole", "segments-of-2"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=dtype_id)
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in CASES])
def test_fused_forward(case, dtype, split, which, VT, monkeypatch):
    """The pass as the forward (``fused_fwd``: the output warpgroup, o) or as the backward's
    recomputed state pass (``fused_states``: h and δ stored), the other use off; whole sequences
    (no split), or warm-started segments of two chunks (each program first walks back through its
    warm-up chunks: split.warm_plan); programs on value tiles of at most 128 or 64 columns
    (``DELTA[which]["VT"]``)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMAs: compute capability 9")
    for name in ("fused_fwd", "fused_states"):
        monkeypatch.setitem(tuning.DELTA, name, dict(tuning.DELTA[name], on=name == which, VT=VT))
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], warm=bool(split), L=split))
    seen = launched(monkeypatch, fused_fwd, chunk_fwd, split_mod)
    errs, bounds = check_once(case, "gated_delta_rule", 3300 + CASES.index(case), dtype)
    replaced = "state_out_kernel" if which == "fused_fwd" else "state_fwd_kernel"
    assert "fused_fwd_kernel" in seen and replaced not in seen, seen
    if split and max(case[7] or [case[2]]) > 2 * 64:  # a sequence of more than two chunks: segments
        assert "warm_plan_kernel" in seen, seen
    assert_within(errs, bounds, f"warp-specialised forward pass at {case[0]}, {dtype_id(dtype)}, split {split}, VT {VT}")
