"""tools/step_ops.py: one training step's kernel launches and ATen operators, per layer (from two
depths) and in all, with gdn's CUDA paths taken on the CPU. Run in a subprocess: the tool replaces
Triton's launch and the CUDA tests process-wide."""
from __future__ import annotations

import pytest

from .run_tool import run_tool

pytest.importorskip("triton")


def _run(*args):
    return run_tool("step_ops.py", *args)


def test_counts_a_gated_deltanet_layer():
    """The 340m layer (K = 128, V = 256): the Hopper forms of the chunk kernels."""
    res = _run("--preset", "gdn", "--size", "340m", "--layers", "2", "--top", "40")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    per_layer = {}
    section = None
    for ln in lines:
        if ln.startswith("per layer,"):
            section = ln
        elif section and ln.strip():
            n, name = ln.split()
            per_layer[(section, name)] = float(n)
    kern = {name: n for (sec, name), n in per_layer.items() if "kernel" in sec}
    # the chunk op: the inverse and the forward pass, its recomputation in the backward, the reverse
    # pass and the per-chunk backward, once each per layer (Hopper forms); q and k's L2 norms each way
    assert kern.get("kkt_solve_kernel") == 1 and kern.get("fused_fwd_kernel") == 2, kern
    assert kern.get("fused_rev_kernel") == 1 and kern.get("fused_bwd_kernel") == 1, kern
    assert kern.get("l2norm_fwd_kernel") == 2 and kern.get("l2norm_bwd_kernel") == 2, kern
    ops = {name: n for (sec, name), n in per_layer.items() if "ATen" in sec}
    # the joined input projections, o_proj and the MLP's: four products a layer at least, each 3
    assert ops.get("aten.mm.default", 0) >= 3 * 4, ops
    total = [ln for ln in lines if ln.startswith("kernel launches:")][0]
    assert f"{sum(kern.values()):.0f} per layer" in total, (total, kern)


def test_one_layer_is_a_usage_error():
    res = _run("--layers", "1")
    assert res.returncode == 2 and "--layers must be at least 2" in res.stderr and "Traceback" not in res.stderr
