"""The merged backward of the gated delta rule (gdn.ops.delta.triton.fused_rbwd,
``DELTA["fused_rbwd"]``: the reverse pass and the per-chunk gradients in one warp-specialised
kernel) on the GPU: the cases of the warp-specialised forward that pad to K = V = 128 and awkward
ones at that width, bf16 and fp16, against the float64 reference at tier 3, whole sequences or warm-started segments of two
chunks; and the launches show it replaced fused_rev and fused_bwd. Gluon has no interpreter, so
this is its only check of results."""
from __future__ import annotations

import pytest
import torch

from gdn.ops import tuning
from gdn.ops.delta.triton import chunk_bwd, fused_rbwd
from gdn.ops.delta.triton import split as split_mod

from .helpers import assert_within, dtype_id, launched, poison_empty
from .test_chunk import check_once
from .test_fused_fwd import CASES, _width

#: the forward's cases at K = V = 128 after padding, and the awkward ones at K = V = 128: a token,
#: partial chunks, grouped heads, packed sequences around empty and one-token ones (with initial
#: and final states), K and V padded from 100 and 72
RCASES = [c for c in CASES if _width(c[5]) == 128 and _width(c[6]) == 128] + [
    ("T=1 K=V=128", 4, 1, 2, 4, 128, 128, None, True),
    ("T=63 grouped", 2, 63, 2, 4, 128, 128, None, True),
    ("T=65 K=100 V=72", 1, 65, 2, 4, 100, 72, None, True),
    ("packed K=V=128", 1, 360, 2, 4, 128, 128, (65, 1, 0, 63, 128, 103), True),
]


def _check(case, dtype, split, monkeypatch, **setting):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMAs: compute capability 9")
    monkeypatch.setitem(tuning.DELTA, "fused_rbwd", dict(tuning.DELTA["fused_rbwd"], on=True, **setting))
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], warm=bool(split), L=split))
    seen = launched(monkeypatch, fused_rbwd, chunk_bwd, split_mod)
    poison_empty(monkeypatch)
    errs, bounds = check_once(case, "gated_delta_rule", 3500 + RCASES.index(case), dtype)
    assert "fused_rbwd_kernel" in seen and "fused_rev_kernel" not in seen and "fused_bwd_kernel" not in seen, seen
    if split and max(case[7] or [case[2]]) > 2 * 64:  # a sequence of more than two chunks: segments
        assert "warm_plan_kernel" in seen, seen
    assert_within(errs, bounds, f"merged backward {setting or ''} at {case[0]}, {dtype_id(dtype)}, split {split}")


@pytest.mark.parametrize("split", (0, 2), ids=("whole", "segments-of-2"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=dtype_id)
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in RCASES])
def test_merged_backward(case, dtype, split, monkeypatch):
    """Whole sequences, or warm-started segments of two chunks (each program first walks the
    warm-up chunks after its segment: the chain's work only). Fresh buffers hold NaN
    (``poison_empty``)."""
    _check(case, dtype, split, monkeypatch)


#: the other settings: another split of the registers between A and B (a split changes what ptxas
#: spills and where, so each one timed is checked), dγ's pair terms formed by B (``qk_b``), dK's
#: terms through M and dW formed by B and handed to A in fp32 (``dk_b``), and both
FORMS = [dict(regs=(24, 192, 136)), dict(qk_b=True), dict(qk_b=True, regs=(24, 176, 152)),
         dict(dk_b=True, regs=(24, 168, 160)), dict(dk_b=True, qk_b=True, regs=(24, 160, 168))]


@pytest.mark.parametrize("form", FORMS, ids=("regs-192-136", "qk-b", "qk-b-regs-176-152", "dk-b", "dk-b-qk-b"))
@pytest.mark.parametrize("split", (0, 2), ids=("whole", "segments-of-2"))
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in RCASES])
def test_merged_backward_forms(case, split, form, monkeypatch):
    """Each other setting, bf16: the same cases."""
    _check(case, torch.bfloat16, split, monkeypatch, **form)
