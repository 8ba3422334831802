"""The chunk op captured in CUDA graphs (``torch.cuda.make_graphed_callables``: forward and backward
each one graph, as a training step under ``torch.compile(mode="reduce-overhead")`` replays them) on
a GPU: replays give the eager outputs and gradients, also after other pinned host buffers were
allocated and overwritten between capture and replay. The layouts are the ones whose index tensors
the op builds on the host and copies in while it is captured: warm-started segments (few long
sequences) and the sliced reverse pass; and a packed call with its offsets on the GPU, captured
after an eager call with them (whose host copy of the offsets the capture reads). Skipped without
a CUDA device (conftest)."""
from __future__ import annotations

import pytest
import torch

import gdn.ops as ops
from gdn.ops import tuning
from gdn.ops.delta.triton import chunk_bwd, chunk_fwd, fused_fwd, fused_rev
from gdn.ops.delta.triton import split as split_mod

from .helpers import launched, offsets, rel_err


def _inputs(B, T, H, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    q = r(B, T, H, 128).to(torch.bfloat16)
    k = torch.nn.functional.normalize(r(B, T, H, 128), dim=-1).to(torch.bfloat16)
    v = r(B, T, H, 128).to(torch.bfloat16)
    g = -torch.rand(B, T, H, generator=gen, device="cuda") * 0.1
    beta = torch.rand(B, T, H, generator=gen, device="cuda")
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _op(q, k, v, g, beta):
    return ops.gated_delta_rule(q, k, v, g, beta, backend="triton")[0]


def _churn_pinned():
    """Pinned host buffers of the sizes the op's index copies take, allocated and filled with
    garbage (what a replay would read if the op's own pinned sources had been reused)."""
    return [torch.full((n,), -12345, dtype=torch.int32).pin_memory() for n in (16, 64, 256, 1024) for _ in range(8)]


@pytest.mark.parametrize("layout", ("segments", "slices"))
def test_captured_forward_and_backward_replay_like_eager(layout, monkeypatch):
    """segments: one sequence of 8192 tokens at two heads (two programs: the passes split it into
    warm-started segments); slices: (4, 2048) at 16 heads with a reverse pass budget of 1 MiB (one
    slice per chunk position, capped at four)."""
    if layout == "slices":
        monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], slice_MB=1, max_slices=4))
        B, T, H = 4, 2048, 16
    else:
        B, T, H = 1, 8192, 2
    seen = launched(monkeypatch, fused_rev, chunk_bwd, chunk_fwd, fused_fwd, split_mod)
    sample = _inputs(B, T, H, 0)
    graphed = torch.cuda.make_graphed_callables(_op, tuple(sample))
    for seed in (1, 2):
        keep = _churn_pinned()
        xs = _inputs(B, T, H, seed)
        do = torch.randn(B, T, H, 128, device="cuda", dtype=torch.bfloat16)
        o = graphed(*xs)
        o.backward(do)
        got = [o.detach().clone()] + [x.grad.clone() for x in xs]
        ys = [x.detach().clone().requires_grad_() for x in xs]
        n0 = len(seen)
        o_e = _op(*ys)
        o_e.backward(do)
        eager = seen[n0:]  # (the replays launch nothing from Python)
        want = [o_e.detach()] + [y.grad for y in ys]
        for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, want):
            assert rel_err(a, b) <= 1e-5, (layout, seed, name, rel_err(a, b))
        del keep
        if layout == "segments":
            assert "warm_plan_kernel" in eager, eager
        else:
            assert eager.count("fused_rev_kernel") > 1 or eager.count("state_bwd_kernel") > 1, eager


def test_a_packed_call_is_captured_after_an_eager_one():
    """Forward and backward of four packed sequences (cu_seqlens on the GPU) captured in one graph
    after an eager call with the same offsets tensor: the replay gives the eager outputs and
    gradients. A capture with offsets no eager call has read is refused, naming cu_seqlens."""
    lens = [300, 1200, 64, 484]
    cu = offsets(lens, "cuda")
    xs = _inputs(1, sum(lens), 4, 3)
    do = torch.randn(1, sum(lens), 4, 128, device="cuda", dtype=torch.bfloat16)

    def call(c):
        o = ops.gated_delta_rule(*xs, cu_seqlens=c, backend="triton")[0]
        o.backward(do)
        return o.detach()

    want = [call(cu).clone()] + [x.grad.clone() for x in xs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in xs:
            x.grad = None
        call(cu)
    torch.cuda.current_stream().wait_stream(side)
    for x in xs:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = call(cu)
    keep = _churn_pinned()
    graph.replay()
    torch.cuda.synchronize()
    got = [o] + [x.grad for x in xs]
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    del keep
    for x in xs:
        x.grad = None
    unread = offsets(lens, "cuda")  # made before the capture: no host copy may enter one
    with pytest.raises(ValueError, match="cu_seqlens"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            call(unread)
