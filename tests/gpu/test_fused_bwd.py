"""The Gluon fused backward of the gated delta rule (``DELTA["fused_bwd"]``, gdn.ops.delta.triton.
fused_bwd) on the GPU: the cases of test_chunk.py that it takes (K of 32-128 after padding, V a
multiple of its value tile), bf16 and fp16, against the float64 reference at tier 3; and the
launches show it replaced dqk and wy_bwd. Gluon has no interpreter, so this is its only check of
results."""
from __future__ import annotations

import pytest
import torch

from gdn.ops import tuning
from gdn.ops.delta.triton import chunk_bwd, fused_bwd

from .helpers import assert_within, dtype_id, launched
from .test_chunk import AWKWARD, BENCH, check_once

CASES = [c for c in AWKWARD if max(32, c[5]) <= 128] + [BENCH[0], BENCH[3]]
SMALL = [c for c in CASES if c in AWKWARD]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=dtype_id)
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in CASES])
def test_fused_backward(case, dtype, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMAs: compute capability 9")
    monkeypatch.setitem(tuning.DELTA, "fused_bwd", dict(tuning.DELTA["fused_bwd"], on=True))
    seen = launched(monkeypatch, fused_bwd, chunk_bwd)
    errs, bounds = check_once(case, "gated_delta_rule", 3000 + CASES.index(case), dtype)
    assert "fused_bwd_kernel" in seen and "dqk_kernel" not in seen and "wy_bwd_kernel" not in seen, seen
    assert_within(errs, bounds, f"fused backward at {case[0]}, {dtype_id(dtype)}")


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in SMALL])
def test_fused_backward_outputs_match_its_transcription(case, monkeypatch):
    """Each output of the kernel (dQ, dK, dV, dg, dβ per value head, before any group sum) against
    tests/ops/test_fused_bwd_math.py's transcription of it run on the same intermediates (on the
    CPU, in fp32): which output goes wrong, when the end-to-end check above fails."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMAs: compute capability 9")
    from tests.ops.test_fused_bwd_math import transcription

    monkeypatch.setitem(tuning.DELTA, "fused_bwd", dict(tuning.DELTA["fused_bwd"], on=True))
    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], slice_MB=0))
    real = fused_bwd.backward
    diffs = {}

    def both(*args):
        got, run = real(*args)
        ch = args[11]

        def checked(chunk_idx, rows, NT):
            # the inputs copied once the reverse pass has filled dh and dδ, before the kernel runs:
            # it writes dV and dQ over dδ and δ
            cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
            cpu[11] = type("Ch", (), {"chunk_idx": ch.chunk_idx.cpu(), "cu": ch.cu.cpu()})()
            run(chunk_idx, rows, NT)
            want = transcription(*cpu)
            for name, x, y in zip(("dq", "dk", "dv", "dg", "db"), got, want):
                y = y.float()
                diffs[name] = float((x.float().cpu() - y).norm() / y.norm().clamp_min(1e-30))

        return got, checked

    monkeypatch.setattr(fused_bwd, "backward", both)
    check_once(case, "gated_delta_rule", 3100 + SMALL.index(case), torch.bfloat16)
    assert diffs and all(v < 2e-2 for v in diffs.values()), diffs


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=dtype_id)
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in SMALL[:4] + [BENCH[0]]])
def test_pair_backward(case, dtype, monkeypatch):
    """The pair the fused kernel replaces (dqk, wy_bwd: what GPUs without warpgroup MMAs run, and
    every other member) still gives the reference's gradients for the gated delta rule in 16 bits."""
    monkeypatch.setitem(tuning.DELTA, "fused_bwd", dict(tuning.DELTA["fused_bwd"], on=False))
    seen = launched(monkeypatch, fused_bwd, chunk_bwd)
    errs, bounds = check_once(case, "gated_delta_rule", 3200 + CASES.index(case), dtype)
    assert "dqk_kernel" in seen and "wy_bwd_kernel" in seen, seen
    assert_within(errs, bounds, f"dqk + wy_bwd at {case[0]}, {dtype_id(dtype)}")


SLICED = [c for c in SMALL if c[0] in ("T=300 K=V=128", "packed")] + [BENCH[0]]


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in SLICED])
def test_sliced_reverse_pass(case, monkeypatch):
    """The reverse pass and the per-chunk kernels run slice by slice (``DELTA["state_bwd"]["slice_MB"]``
    forced below every dh, so each slice holds one chunk of each sequence): the same errors against
    the reference as the unsliced backward, to the bit, with the fused kernel (on compute capability
    9) or the pair; the reverse pass is state_bwd here (tests/gpu/test_fused_rev.py slices its
    warp-specialised form)."""
    seed = 3300 + CASES.index(case)
    monkeypatch.setitem(tuning.DELTA, "fused_rev", dict(tuning.DELTA["fused_rev"], on=False))
    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], slice_MB=0))
    whole = check_once(case, "gated_delta_rule", seed, torch.bfloat16)[0]
    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], slice_MB=1e-6, max_slices=10 ** 9))
    seen = launched(monkeypatch, fused_bwd, chunk_bwd)
    sliced = check_once(case, "gated_delta_rule", seed, torch.bfloat16)[0]
    assert seen.count("state_bwd_kernel") > 1, seen
    assert sliced == whole, (sliced, whole)


#: (name, B, T, H, HV, K, V, lens, initial state): 7 chunks of 3 value heads over one key head (21
#: items: a partial last group at 2 items a program, and at 4), the awkward packed case (8 chunks,
#: HV = 4 over H = 2), partial chunks at K = V = 128 (20 items: partial groups at 3), and grouped
#: heads at a benchmark shape
ITEMS = [("packed, 7 chunks, HV=3", 1, 260, 1, 3, 64, 64, (65, 1, 0, 63, 131), True),
         next(c for c in SMALL if c[0] == "packed"), next(c for c in SMALL if c[0] == "T=300 K=V=128"),
         BENCH[3]]


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in ITEMS])
def test_items_a_program(case, monkeypatch):
    """Several (chunk, value head) items a program (``DELTA["fused_bwd"]["items"]`` of 2, 3 and 4,
    the next item's copies requested during this one's epilogue): the kernel's outputs equal, to
    the bit, one item a program's on the same inputs (copies of what the reverse pass left: the
    kernel writes dV and dQ over two of them)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMAs: compute capability 9")
    from .helpers import leaves, outputs_and_grads
    from .test_chunk import _call, draw, triton_op

    monkeypatch.setitem(tuning.DELTA, "fused_bwd", dict(tuning.DELTA["fused_bwd"], on=True, items=1))
    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], slice_MB=0))  # one launch
    real = fused_bwd.backward
    calls = []

    def grab(*args):
        got, run = real(*args)

        def copied(chunk_idx, rows, NT):
            # the inputs copied once the reverse pass has filled dh and dδ, before the kernel runs
            calls.append(([a.clone() if isinstance(a, torch.Tensor) else a for a in args], chunk_idx.clone(),
                          rows.clone(), NT))
            run(chunk_idx, rows, NT)

        return got, copied

    monkeypatch.setattr(fused_bwd, "backward", grab)
    _, B, T, H, HV, K, V, lens, state = case
    d, cu, do, dS = draw("gated_delta_rule", B, T, H, HV, K, V, lens, state, 3400 + ITEMS.index(case))
    outputs_and_grads(_call(triton_op("gated_delta_rule"), "gated_delta_rule", cu), leaves(d, torch.bfloat16),
                      do, dS)
    assert calls  # one launch per backward the test's call runs

    def outputs(saved, chunk_idx, rows, NT, items):
        tuning.DELTA["fused_bwd"]["items"] = items
        got, run = real(*[a.clone() if isinstance(a, torch.Tensor) else a for a in saved])
        run(chunk_idx, rows, NT)
        torch.cuda.synchronize()
        return got

    for call in calls:
        one = outputs(*call, 1)
        for items in (2, 3, 4):
            for name, x, y in zip(("dq", "dk", "dv", "dg", "db"), outputs(*call, items), one):
                # to the bit, NaN where one item a program leaves NaN (rows no launch of this
                # call writes, in the test's own fresh buffers)
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True,
                                           msg=lambda m, name=name, items=items: f"{name} at {items} items: {m}")
