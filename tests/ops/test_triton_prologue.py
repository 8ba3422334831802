"""Fused prologue (gdn.ops.delta.triton.prologue) under Triton's interpreter, and gdn.ops.gated_delta_rule_fused
on the CPU.

The Triton entry point (L2-norm, gate and β in kernels, then the chunk kernels) must match the
PyTorch prologue + float64 recurrence in outputs, final state and the gradients of q, k, v, a, b,
A_log, dt_bias and the initial state.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from gdn.ops import gated_delta_rule_fused  # noqa: E402
from gdn.ops.tuning import INTERPRET  # noqa: E402

from .helpers import rel_err  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET was set in this process", allow_module_level=True)

from gdn.ops.delta.fused import run_fused  # noqa: E402


def _inputs(B, T, H, HV, K, V, N, seed):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    return {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, HV, V), "a": r(B, T, HV), "b": r(B, T, HV),
            "A_log": r(HV) * 0.5, "dt_bias": r(HV) * 0.5, "initial_state": r(N, HV, K, V) * 0.3}


@pytest.mark.parametrize("neg", [False, True])
@pytest.mark.parametrize("lens", [None, [40, 0, 25]])
def test_triton_prologue_matches_reference(neg, lens):
    B = 2 if lens is None else 1
    T = 65
    N = B if lens is None else len(lens)
    cu = None if lens is None else torch.tensor([0, 40, 40, 65])
    d = _inputs(B, T, 1, 2, 16, 16, N, seed=11)
    names = list(d)
    ref = {n: x.clone().requires_grad_(True) for n, x in d.items()}
    got = {n: x.float().clone().requires_grad_(True) for n, x in d.items()}
    kw = dict(initial_state=None, output_final_state=True, cu_seqlens=cu, allow_neg_eigval=neg)
    args = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
    o_r, S_r = gated_delta_rule_fused(*[ref[n] for n in args], **{**kw, "initial_state": ref["initial_state"]},
                                      backend="naive")
    o, S = run_fused("triton-chunk", *[got[n] for n in args], **{**kw, "initial_state": got["initial_state"]})
    gen = torch.Generator().manual_seed(3)
    do, dS = torch.randn(o_r.shape, generator=gen, dtype=torch.float64), torch.randn(S_r.shape, generator=gen,
                                                                                      dtype=torch.float64)
    ((o_r * do).sum() + (S_r * dS).sum()).backward()
    ((o.double() * do).sum() + (S.double() * dS).sum()).backward()
    errs = {"o": rel_err(o, o_r), "S": rel_err(S, S_r)}
    errs.update({"d" + n: rel_err(got[n].grad, ref[n].grad) for n in names})
    bad = {k: v for k, v in errs.items() if not v <= 1e-4}
    assert not bad, bad


def test_fused_cpu_matches_layer_math():
    d = _inputs(1, 20, 2, 4, 8, 8, 1, seed=2)
    o, S = gated_delta_rule_fused(d["q"], d["k"], d["v"], d["a"], d["b"], d["A_log"], d["dt_bias"],
                                  output_final_state=True, backend="naive")
    qn = torch.nn.functional.normalize(d["q"], dim=-1, eps=0)
    kn = torch.nn.functional.normalize(d["k"], dim=-1, eps=0)
    g = -d["A_log"].exp() * torch.nn.functional.softplus(d["a"] + d["dt_bias"])
    from gdn.ops import gated_delta_rule

    o2, S2 = gated_delta_rule(qn, kn, d["v"], g, torch.sigmoid(d["b"]), output_final_state=True, backend="naive")
    assert rel_err(o, o2) < 1e-5 and rel_err(S, S2) < 1e-5


def test_fused_rejects_bad_params():
    d = _inputs(1, 4, 1, 2, 8, 8, 1, seed=0)
    with pytest.raises(ValueError, match="A_log"):
        gated_delta_rule_fused(d["q"], d["k"], d["v"], d["a"], d["b"], d["A_log"][:1], d["dt_bias"])
    with pytest.raises(ValueError, match="b must"):
        gated_delta_rule_fused(d["q"], d["k"], d["v"], d["a"], d["b"][..., :1], d["A_log"], d["dt_bias"])
    with pytest.raises(ValueError, match="triton"):
        gated_delta_rule_fused(d["q"], d["k"], d["v"], d["a"], d["b"], d["A_log"], d["dt_bias"], backend="triton")
