"""Tier 2 (DESIGN §5): the chunkwise PyTorch forms against the recurrences, outputs, states, gradients."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn.ops.delta import chunk as Ch
from gdn.ops.delta import reference as R

from .helpers import HAS_BETA, HAS_G, MEMBERS, call, make_inputs, rel_err

AWKWARD = [  # (B, T, H, HV, K, V, chunk)
    (1, 1, 1, 1, 16, 16, 64),
    (2, 63, 1, 2, 16, 60, 16),
    (1, 65, 2, 4, 60, 16, 64),
    (1, 300, 1, 1, 100, 64, 64),
    (2, 64, 2, 2, 64, 100, 32),
    (1, 37, 1, 1, 128, 16, 7),
]


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_chunk_matches_reference_float64(member, shape):
    B, T, H, HV, K, V, C = shape
    d = make_inputs(B, T, H, HV, K, V)
    o, S = call(Ch, member, d, output_final_state=True, chunk_size=C)
    o_ref, S_ref = call(R, member, d, output_final_state=True)
    assert o.dtype == torch.float64 and S.dtype == torch.float64
    assert rel_err(o, o_ref) < 1e-10
    assert rel_err(S, S_ref) < 1e-10


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("shape", AWKWARD[1:4], ids=lambda s: "x".join(map(str, s)))
def test_chunk_matches_reference_float32(member, shape):
    B, T, H, HV, K, V, C = shape
    d = make_inputs(B, T, H, HV, K, V)
    d32 = {n: (x.float() if x is not None else None) for n, x in d.items()}
    o, S = call(Ch, member, d32, output_final_state=True, chunk_size=C)
    o_ref, S_ref = call(R, member, d, output_final_state=True)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(S, S_ref) <= 1e-5


def test_chunk_half_inputs_accumulate_in_fp32():
    d = make_inputs(1, 70, 2, 2, 32, 32, dtype=torch.float16)
    o, S = Ch.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                               output_final_state=True)
    assert o.dtype == torch.float16 and S.dtype == torch.float32
    o_ref, S_ref = R.gated_delta_rule(*(d[n].double() for n in ("q", "k", "v", "g", "beta")),
                                      initial_state=d["initial_state"].double(), output_final_state=True)
    assert rel_err(o, o_ref) < 2e-3 and rel_err(S, S_ref) < 1e-5


@settings(max_examples=25, deadline=None)
@given(
    member=st.sampled_from(MEMBERS),
    B=st.integers(1, 2), T=st.integers(1, 80), H=st.integers(1, 2), G=st.integers(1, 3),
    K=st.sampled_from([1, 3, 8, 17]), V=st.sampled_from([1, 5, 8, 20]), C=st.integers(1, 40),
    state=st.booleans(),
)
def test_chunk_matches_reference_fuzzed_shapes(member, B, T, H, G, K, V, C, state):
    d = make_inputs(B, T, H, H * G, K, V, state=state)
    o, S = call(Ch, member, d, output_final_state=True, chunk_size=C)
    o_ref, S_ref = call(R, member, d, output_final_state=True)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(S, S_ref) < 1e-10


@pytest.mark.parametrize("member", MEMBERS)
def test_chunk_gradcheck_float64(member):
    """torch.autograd.gradcheck through every differentiable input, state included."""
    d = make_inputs(1, 10, 1, 2, 3, 4, requires_grad=True)
    names = ["q", "k", "v"] + (["g"] if HAS_G[member] else []) + (["beta"] if HAS_BETA[member] else [])
    names.append("initial_state")

    def f(*xs):
        dd = dict(zip(names, xs))
        o, S = call(Ch, member, dd, output_final_state=True, chunk_size=4)
        return o, S

    assert torch.autograd.gradcheck(f, tuple(d[n] for n in names), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("member", MEMBERS)
def test_chunk_gradients_match_reference(member):
    d = make_inputs(2, 50, 2, 4, 16, 12, requires_grad=True)
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state")
             if n in ("q", "k", "v", "initial_state") or (n == "g" and HAS_G[member]) or (n == "beta" and HAS_BETA[member])]
    grads = []
    for mod in (Ch, R):
        kw = {"chunk_size": 16} if mod is Ch else {}
        o, S = call(mod, member, d, output_final_state=True, **kw)
        gen = torch.Generator().manual_seed(1)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (S * S).sum()
        grads.append(torch.autograd.grad(loss, [d[n] for n in names]))
    for n, a, b in zip(names, *grads):
        assert rel_err(a, b) < 1e-10, n


@pytest.mark.parametrize("member", MEMBERS)
def test_packed_sequences_equal_separate_runs(member):
    lens = [5, 0, 64, 1, 30]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    T = int(cu[-1])
    d = make_inputs(1, T, 2, 4, 16, 8, N=len(lens))
    o, S = call(Ch, member, d, output_final_state=True, cu_seqlens=cu, chunk_size=16)
    o_r, S_r = call(R, member, d, output_final_state=True, cu_seqlens=cu)
    assert rel_err(o, o_r) < 1e-10 and rel_err(S, S_r) < 1e-10
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {name: (x[:, s:e] if name != "initial_state" else x[n : n + 1]) for name, x in d.items()}
        if e == s:
            assert torch.equal(S[n], d["initial_state"][n])  # an empty sequence hands its state back
            continue
        o_n, S_n = call(Ch, member, part, output_final_state=True, chunk_size=16)
        assert rel_err(o[:, s:e], o_n) < 1e-12 and rel_err(S[n : n + 1], S_n) < 1e-12


@pytest.mark.parametrize("member", MEMBERS)
def test_state_handover_equals_one_run(member):
    d = make_inputs(2, 90, 1, 2, 16, 16)
    o, S = call(Ch, member, d, output_final_state=True, chunk_size=32)
    first = {n: (x[:, :37] if n != "initial_state" else x) for n, x in d.items()}
    o1, S1 = call(Ch, member, first, output_final_state=True, chunk_size=32)
    second = {n: (x[:, 37:] if n != "initial_state" else S1) for n, x in d.items()}
    o2, S2 = call(Ch, member, second, output_final_state=True, chunk_size=32)
    assert rel_err(torch.cat([o1, o2], 1), o) < 1e-12 and rel_err(S2, S) < 1e-12


@pytest.mark.parametrize(
    "case", ["g0", "g-1e4", "beta0", "beta1"],
)
def test_extremes_stay_finite_and_match(case):
    d = make_inputs(1, 70, 2, 2, 16, 16, dtype=torch.float32, requires_grad=False)
    if case == "g0":
        d["g"] = torch.zeros_like(d["g"])
    elif case == "g-1e4":
        d["g"] = torch.full_like(d["g"], -1e4)
    elif case == "beta0":
        d["beta"] = torch.zeros_like(d["beta"])
    else:
        d["beta"] = torch.ones_like(d["beta"])
    for n in d:
        if d[n] is not None:
            d[n].requires_grad_(True)
    o, S = Ch.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                               output_final_state=True, chunk_size=32)
    o_r, S_r = R.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                  output_final_state=True)
    assert rel_err(o, o_r) < 1e-5 and rel_err(S, S_r) < 1e-5
    gc = torch.autograd.grad(o.sum() + S.sum(), [d["q"], d["k"], d["v"], d["g"], d["beta"], d["initial_state"]])
    gr = torch.autograd.grad(o_r.sum() + S_r.sum(), [d["q"], d["k"], d["v"], d["g"], d["beta"], d["initial_state"]])
    for a, b in zip(gc, gr):
        assert torch.isfinite(a).all()
        assert rel_err(a, b) < 1e-4 or (b.norm() < 1e-6 and a.norm() < 1e-4)


def test_long_sequence_16384():
    d = make_inputs(1, 16384, 1, 1, 8, 8, dtype=torch.float32, g_scale=0.05)
    o, S = Ch.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                               output_final_state=True)
    o_r, S_r = R.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                  output_final_state=True)
    assert rel_err(o, o_r) < 1e-5 and rel_err(S, S_r) < 1e-5


def test_bad_chunk_size_raises():
    d = make_inputs(1, 4, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="chunk_size"):
        Ch.delta_rule(d["q"], d["k"], d["v"], d["beta"], chunk_size=0)


@pytest.mark.parametrize("C", [1, 2, 7, 16, 64, 100])
def test_unit_lower_inverse(C):
    A = torch.randn(3, 2, C, C, dtype=torch.float64).tril(-1) * 0.3
    T = Ch.unit_lower_inverse(A)
    eye = torch.eye(C, dtype=torch.float64)
    assert torch.allclose((eye + A) @ T, eye.expand_as(A), atol=1e-12)
    assert torch.equal(T.triu(1), torch.zeros_like(T))  # lower triangular, unit diagonal
    assert torch.allclose(T.diagonal(dim1=-2, dim2=-1), torch.ones(3, 2, C, dtype=torch.float64))
