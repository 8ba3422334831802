"""The public ops API: dispatch between backends and argument validation (DESIGN §2)."""
from __future__ import annotations

import pytest
import torch

import gdn.ops as ops
from gdn.ops.delta import chunk as Ch
from gdn.ops.delta import reference as R

from .helpers import MEMBERS, call, make_inputs, rel_err


@pytest.mark.parametrize("member", MEMBERS)
def test_default_backend_agrees_with_naive(member):
    d = make_inputs(2, 40, 2, 4, 8, 8)
    o, S = call(ops, member, d, output_final_state=True)
    o_r, S_r = call(ops, member, d, output_final_state=True, backend="naive")
    assert rel_err(o, o_r) < 1e-10 and rel_err(S, S_r) < 1e-10


def test_final_state_only_when_asked():
    d = make_inputs(1, 5, 1, 1, 4, 4)
    for backend in ("naive", "chunk", None):
        o, S = call(ops, "gated_delta_rule", d, backend=backend)
        assert S is None and o.shape == (1, 5, 1, 4)


def test_decode_step_takes_the_recurrent_path(monkeypatch):
    """T == 1 (or N packed one-token sequences) runs the O(K·V) recurrence, not the chunk form."""
    d = make_inputs(3, 1, 2, 4, 8, 8)
    calls = []
    monkeypatch.setattr(Ch, "gated_delta_rule", lambda *a, **k: calls.append("chunk"))
    o, S = call(ops, "gated_delta_rule", d, output_final_state=True)
    assert not calls
    o_r, S_r = call(R, "gated_delta_rule", d, output_final_state=True)
    assert torch.equal(o, o_r) and torch.equal(S, S_r)
    # the same step as 3 packed one-token sequences
    packed = {n: (x.transpose(0, 1) if n != "initial_state" else x) for n, x in d.items()}
    o_p, S_p = call(ops, "gated_delta_rule", packed, output_final_state=True, cu_seqlens=torch.arange(4))
    assert not calls
    assert rel_err(o_p.transpose(0, 1), o) < 1e-14 and rel_err(S_p, S) < 1e-14


def test_decode_continues_a_prefill():
    d = make_inputs(2, 33, 1, 2, 8, 8)
    o, S = call(ops, "gated_delta_rule", d, output_final_state=True)
    pre = {n: (x[:, :32] if n != "initial_state" else x) for n, x in d.items()}
    _, S1 = call(ops, "gated_delta_rule", pre, output_final_state=True)
    step = {n: (x[:, 32:] if n != "initial_state" else S1) for n, x in d.items()}
    o2, S2 = call(ops, "gated_delta_rule", step, output_final_state=True)
    assert rel_err(o2, o[:, 32:]) < 1e-12 and rel_err(S2, S) < 1e-12


def test_triton_backend_on_cpu_raises():
    d = make_inputs(1, 4, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="triton"):
        call(ops, "gated_delta_rule", d, backend="triton")


def test_available_backends_on_cpu():
    assert ops.available_backends("cpu") == ["naive", "chunk"]


def _gdn(d, **kw):
    args = dict(initial_state=d.get("initial_state"))
    args.update(kw)
    return ops.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], **args)


BAD = {
    "q rank": (lambda d: {**d, "q": d["q"][0], "k": d["k"][0]}, ValueError, r"q must have shape \[B, T, H, K\]"),
    "k shape": (lambda d: {**d, "k": d["k"][:, :, :, :3]}, ValueError, "k must have the shape of q"),
    "v time": (lambda d: {**d, "v": d["v"][:, :3]}, ValueError, "v must have shape"),
    "HV not multiple": (lambda d: {**d, "v": d["v"][:, :, :3], "g": d["g"][:, :, :3], "beta": d["beta"][:, :, :3],
                                   "initial_state": None}, ValueError, "multiple of the H = 2"),
    "g shape": (lambda d: {**d, "g": d["g"][..., :1]}, ValueError, r"g must have shape \[B, T, HV\]"),
    "beta shape": (lambda d: {**d, "beta": d["beta"][None]}, ValueError, r"beta must have shape \[B, T, HV\]"),
    "integer q": (lambda d: {**d, "q": d["q"].long()}, ValueError, "q must be a floating-point"),
    "not a tensor": (lambda d: {**d, "v": d["v"].tolist()}, TypeError, "v must be a torch.Tensor"),
    "state shape": (lambda d: {**d, "initial_state": d["initial_state"][:, :1]}, ValueError,
                    r"initial_state must have shape \[N, HV, K, V\] = \[2, 4, 8, 6\]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_raise_naming_the_argument(case):
    d = make_inputs(2, 5, 2, 4, 8, 6)
    mutate, exc, pattern = BAD[case]
    with pytest.raises(exc, match=pattern):
        _gdn(mutate(d))


def test_bad_cu_seqlens():
    d = make_inputs(1, 10, 1, 1, 4, 4, N=2)
    with pytest.raises(ValueError, match="non-decreasing"):
        _gdn(d, cu_seqlens=torch.tensor([0, 7, 5, 10]), initial_state=None)
    with pytest.raises(ValueError, match="end at T = 10"):
        _gdn(d, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="int32 or int64"):
        _gdn(d, cu_seqlens=torch.tensor([0.0, 4.0, 10.0]))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, HV, K, V\] = \[3"):
        _gdn(d, cu_seqlens=torch.tensor([0, 4, 6, 10]))
    d2 = make_inputs(2, 10, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="B == 1"):
        _gdn(d2, cu_seqlens=torch.tensor([0, 4, 10]))


def test_bad_backend_and_scale():
    d = make_inputs(1, 4, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="backend must be"):
        _gdn(d, backend="cuda")
    with pytest.raises(TypeError, match="scale"):
        _gdn(d, scale="0.5")


def test_kimi_delta_attention_dispatch_and_validation():
    d = make_inputs(1, 20, 2, 4, 8, 6)
    g = -torch.rand(1, 20, 4, 8, dtype=torch.float64) * 0.5
    o, S = ops.kimi_delta_attention(d["q"], d["k"], d["v"], g, d["beta"], initial_state=d["initial_state"],
                                    output_final_state=True)
    o_r, S_r = ops.kimi_delta_attention(d["q"], d["k"], d["v"], g, d["beta"], initial_state=d["initial_state"],
                                        output_final_state=True, backend="naive")
    assert rel_err(o, o_r) < 1e-10 and rel_err(S, S_r) < 1e-10
    # a per-channel gate equal across channels is the scalar gated delta rule
    gs = g[..., :1].expand_as(g)
    o_k, _ = ops.kimi_delta_attention(d["q"], d["k"], d["v"], gs, d["beta"], initial_state=d["initial_state"])
    o_g, _ = ops.gated_delta_rule(d["q"], d["k"], d["v"], gs[..., 0], d["beta"], initial_state=d["initial_state"])
    assert rel_err(o_k, o_g) < 1e-10
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, HV, K\]"):
        ops.kimi_delta_attention(d["q"], d["k"], d["v"], g[..., 0], d["beta"])
    with pytest.raises(ValueError, match="triton"):
        ops.kimi_delta_attention(d["q"], d["k"], d["v"], g, d["beta"], backend="triton")
