"""δ and dδ formed again by the fused backward instead of stored (``DELTA["fused_bwd"]["delta_on_chip"]``,
``["ddelta_on_chip"]``),
recorded on the CPU with a Hopper card's device rules (gdn.ops.triton.launch.recording: nothing
runs): where it is on and the fused per-chunk kernel takes the call with every value tile of an item
in its ring (V = 128), the recomputed state pass stores no δ (the reverse pass no dδ) and the
per-chunk kernel forms it; at
V = 256 (four tiles, two slots), or off, both keep the stored form. The kernel compiles for sm_90
within its budget (tests/test_gluon_budget.py); its results are checked on the GPU
(tests/gpu/test_fused_bwd.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn.ops import tuning  # noqa: E402
from gdn.ops.delta.triton import fused_bwd, fused_rev  # noqa: E402
from tests.test_fused_fwd_dispatch import _record, hopper  # noqa: E402, F401  (hopper: a fixture)


@pytest.fixture
def card(hopper, monkeypatch):
    for mod in (fused_bwd, fused_rev):
        monkeypatch.setattr(mod, "hopper", lambda q: True)


def _backward(V, on, dd_on, monkeypatch):
    monkeypatch.setitem(tuning.DELTA, "fused_bwd", dict(tuning.DELTA["fused_bwd"], delta_on_chip=on,
                                                        ddelta_on_chip=dd_on))
    _, bwd = _record(2, 512, 4, 4, 128, V, torch.bfloat16, True)
    states = [m for k, _, _, m in bwd if k.fn.__name__ == "fused_fwd_kernel"]
    reverse = [m for k, _, _, m in bwd if k.fn.__name__ == "fused_rev_kernel"]
    per_chunk = [m for k, _, _, m in bwd if k.fn.__name__ == "fused_bwd_kernel"]
    assert len(states) == 1 and reverse and per_chunk, [k.fn.__name__ for k, *_ in bwd]
    return states[0], reverse, per_chunk


@pytest.mark.parametrize("V, on, dd_on, formed, dd_formed", [(128, True, False, True, False),
                                                               (128, False, True, False, True),
                                                               (128, True, True, True, True),
                                                               (128, False, False, False, False),
                                                               (256, True, True, False, False)])
def test_delta_formed_where_every_value_tile_is_in_the_ring(card, monkeypatch, V, on, dd_on, formed, dd_formed):
    meta, reverse, per_chunk = _backward(V, on, dd_on, monkeypatch)
    assert meta["STORE_H"] and meta["STORE_D"] is not formed, meta
    assert all(m["STORE_DD"] is not dd_formed for m in reverse), reverse
    assert all(m.get("D_ON_CHIP", False) is formed and m.get("DD_ON_CHIP", False) is dd_formed
               for m in per_chunk), per_chunk
