"""Programmatic dependent launch of the Hopper chunk kernels (``DELTA["pdl"]``) on the GPU: the
same kernels launched so that each may start while the one before it finishes, and waiting for it
before their first read or write, give the same bits as launched one after another, in every
arrangement of the kernels a call makes (whole sequences, the reverse pass and per-chunk kernel in
slices, warm-started segments, packed sequences with initial and final states), eagerly and
replayed from a CUDA graph; and the launches carry the attribute."""
from __future__ import annotations

import pytest
import torch

from gdn.ops import gated_delta_rule, tuning
from gdn.ops.delta.triton import chunk_fwd, fused_bwd, fused_fwd, fused_rev

from .helpers import offsets

CASES = {  # name: (B, T, H, HV, packed lengths or None, initial state and final-state gradient, DELTA changes)
    "whole": (2, 1000, 4, 4, None, False, {}),
    "sliced": (2, 1000, 4, 4, None, True, {"state_bwd": {"slice_MB": 1e-9, "max_slices": 4}}),
    "segments": (1, 2000, 2, 4, None, True, {"split": {"warm": True, "L": 3}}),
    "packed": (1, 1500, 4, 8, [100, 700, 64, 636], True, {}),
}


def _run(B, T, H, HV, lens, states, seed=0, graph=False):
    """o, the final state and every gradient of one gated delta rule call (bf16, K = V = 128)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q = r(B, T, H, 128).bfloat16()
    k = torch.nn.functional.normalize(r(B, T, H, 128), dim=-1).bfloat16()  # (unit keys: a bounded state)
    v = r(B, T, HV, 128).bfloat16()
    g = -torch.rand(B, T, HV, device="cuda", generator=gen) * 0.2
    beta = torch.rand(B, T, HV, device="cuda", generator=gen)
    N = len(lens) if lens else B
    h0 = r(N, HV, 128, 128) if states else None
    xs = [x.requires_grad_() for x in (q, k, v, g, beta) + ((h0,) if states else ())]
    do, dht = r(B, T, HV, 128).bfloat16(), r(N, HV, 128, 128)
    cu = offsets(lens, "cuda") if lens else None

    def call():
        o, ht = gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                 output_final_state=True, cu_seqlens=cu, backend="triton")
        torch.autograd.backward((o, ht), (do, dht))
        return o.detach(), ht.detach()

    if not graph:
        o, ht = call()
    else:  # captured once after two eager calls on the capture's stream, then replayed
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                for x in xs:
                    x.grad = None
                call()
        torch.cuda.current_stream().wait_stream(side)
        for x in xs:
            x.grad = None
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            o, ht = call()
        cg.replay()
        torch.cuda.synchronize()
    return [o, ht] + [x.grad.clone() for x in xs]


@pytest.mark.parametrize("graph", (False, True), ids=("eager", "graph"))
@pytest.mark.parametrize("case", sorted(CASES))
def test_dependent_launches_give_the_same_bits(case, graph, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels: compute capability 9")
    B, T, H, HV, lens, states, changes = CASES[case]
    for name, c in changes.items():
        monkeypatch.setitem(tuning.DELTA, name, dict(tuning.DELTA[name], **c))
    outs = {}
    for on in (False, True):
        monkeypatch.setitem(tuning.DELTA, "pdl", dict(on=on))
        outs[on] = _run(B, T, H, HV, lens, states, graph=graph)
    names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for n, a, b in zip(names, outs[False], outs[True]):
        assert torch.isfinite(a).all(), f"{case}: {n} not finite"
        assert torch.equal(a, b), f"{case}, {'graph' if graph else 'eager'}: {n} differs with dependent launches"


def test_the_hopper_kernels_are_launched_with_the_attribute(monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels: compute capability 9")
    monkeypatch.setitem(tuning.DELTA, "pdl", dict(on=True))
    seen = {}
    for mod in (chunk_fwd, fused_bwd, fused_fwd, fused_rev):
        run = mod.launch

        def spy(kernel, grid, *args, _run=run, **meta):
            seen[kernel.fn.__name__] = meta.get("launch_pdl", False) and meta.get("PDL", False)
            return _run(kernel, grid, *args, **meta)

        monkeypatch.setattr(mod, "launch", spy)
    _run(2, 1000, 4, 4, None, True)
    for name in ("kkt_solve_kernel", "fused_fwd_kernel", "fused_rev_kernel", "fused_bwd_kernel"):
        assert seen.get(name) is True, (name, seen)
