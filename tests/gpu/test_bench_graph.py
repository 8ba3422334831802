"""benchmarks/ops_gpu.py's GPU-bound timing (``graph_ms``, ``--graph``) on the GPU: a gdn call with
its backward is captured, replayed and timed; a call that reads a value back to the host cannot be
captured and gets a note instead of a time."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "ops_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("ops_gpu_graph_test", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_call_and_its_backward_are_timed_from_a_graph(bench):
    xs, cu = bench.inputs(2, 512, 4, 4, None)
    do = torch.randn(2, 512, 4, bench.D, device="cuda", dtype=bench.IO)
    for backward in (False, True):
        ms, why = bench.graph_ms(bench.gdn_fn(xs, cu), backward, do, xs, n=3, rounds=3)
        assert why is None and ms is not None and 0 < ms < 100, (backward, ms, why)
    assert all(x.grad is None for x in xs)  # (the capture's gradients are dropped afterwards)


def test_a_call_that_reads_back_gets_a_note(bench):
    xs, cu = bench.inputs(2, 512, 4, 4, None)
    do = torch.randn(2, 512, 4, bench.D, device="cuda", dtype=bench.IO)
    f = bench.gdn_fn(xs, cu)

    def syncing():
        o = f()
        o.sum().item()  # a host read: not allowed while a graph captures
        return o

    ms, why = bench.graph_ms(syncing, False, do, xs, n=2, rounds=1)
    assert ms is None and why, (ms, why)
