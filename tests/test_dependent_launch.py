"""Programmatic dependent launch of the Hopper chunk kernels (``DELTA["pdl"]``), recorded on the
CPU with a Hopper card's device rules (gdn.ops.triton.launch.recording: nothing runs): the kernels
that wait for their predecessor at their start (kkt_solve and the Gluon passes) are launched with
the attribute and the wait together where it is on, and nothing is where it is off. The GPU checks
that the results are the same bits (tests/gpu/test_pdl.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn.ops import tuning  # noqa: E402
from gdn.ops.delta.triton import fused_bwd, fused_rev  # noqa: E402
from tests.test_fused_fwd_dispatch import _record, hopper  # noqa: E402, F401  (hopper: a fixture)

WAITING = {"kkt_solve_kernel", "fused_fwd_kernel", "fused_rev_kernel", "fused_bwd_kernel"}


@pytest.fixture
def card(hopper, monkeypatch):
    """Every Gluon pass on, as on a Hopper card (the backward's too)."""
    for mod in (fused_bwd, fused_rev):
        monkeypatch.setattr(mod, "hopper", lambda q: True)


def _launches(*shape, h0=True):
    fwd, bwd = _record(*shape, torch.bfloat16, h0)
    return [(kernel.fn.__name__, meta) for kernel, _, _, meta in fwd + bwd]


@pytest.mark.parametrize("shape", [(2, 512, 4, 4, 128, 128), (1, 4096, 2, 4, 128, 128)], ids=("whole", "segments"))
def test_the_waiting_kernels_are_launched_as_dependents(card, monkeypatch, shape):
    monkeypatch.setitem(tuning.DELTA, "pdl", dict(on=True))
    launches = _launches(*shape)
    names = {n for n, _ in launches}
    assert WAITING <= names, names
    for n, meta in launches:
        want = n in WAITING
        assert meta.get("launch_pdl", False) is want and meta.get("PDL", False) is want, (n, meta)


def test_off_no_launch_is_a_dependent(card, monkeypatch):
    monkeypatch.setitem(tuning.DELTA, "pdl", dict(on=False))
    for n, meta in _launches(2, 512, 4, 4, 128, 128):
        assert "launch_pdl" not in meta and "PDL" not in meta, (n, meta)


def test_off_the_card_nothing_is_a_dependent(monkeypatch):
    """Without the Hopper device rules (the CPU, any other card) the flag changes nothing."""
    monkeypatch.setitem(tuning.DELTA, "pdl", dict(on=True))
    for n, meta in _launches(2, 512, 4, 4, 128, 128):
        assert "launch_pdl" not in meta, (n, meta)
