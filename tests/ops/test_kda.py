"""Kimi Delta Attention (per-channel gate): the recurrence and the chunkwise form (tiers 1-2)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn.ops.kda import chunk as KC
from gdn.ops.kda import reference as KR
from gdn.ops.delta import reference as R

from .helpers import make_inputs, rel_err

AWKWARD = [  # (B, T, H, HV, K, V, chunk)
    (1, 1, 1, 1, 16, 16, 64),
    (2, 63, 1, 2, 16, 60, 16),
    (1, 65, 2, 4, 60, 16, 64),
    (1, 300, 1, 1, 100, 64, 64),
    (1, 37, 1, 1, 128, 16, 7),
]


def kda_inputs(B, T, H, HV, K, V, *, dtype=torch.float64, g_scale=0.5, seed=0, N=None, requires_grad=False):
    d = make_inputs(B, T, H, HV, K, V, dtype=dtype, seed=seed, N=N)
    gen = torch.Generator().manual_seed(seed + 1)
    d["g"] = (-torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64) * g_scale).to(dtype)
    if requires_grad:
        for name in ("q", "k", "v", "g", "beta", "initial_state"):
            d[name] = d[name].detach().requires_grad_(True)
    return d


def run(mod, d, **kw):
    return mod.kimi_delta_attention(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                    **kw)


def test_reference_reduces_to_gated_delta_rule_for_uniform_gates():
    d = kda_inputs(2, 20, 2, 4, 8, 8)
    g_scalar = d["g"][..., 0]
    d["g"] = g_scalar[..., None].expand(-1, -1, -1, 8).contiguous()
    o, S = run(KR, d, output_final_state=True)
    o_ref, S_ref = R.gated_delta_rule(d["q"], d["k"], d["v"], g_scalar, d["beta"], initial_state=d["initial_state"],
                                      output_final_state=True)
    assert rel_err(o, o_ref) < 1e-12 and rel_err(S, S_ref) < 1e-12


def test_reference_single_step_closed_form():
    """One token: S = diag(e^g) S0 + β k (v − (diag(e^g) S0)ᵀ k)ᵀ, o = scale Sᵀ q."""
    d = kda_inputs(1, 1, 1, 1, 6, 5)
    q, k, v, g, b, S0 = (d[n][0, 0, 0] if n != "initial_state" else d[n][0, 0]
                         for n in ("q", "k", "v", "g", "beta", "initial_state"))
    Sd = torch.exp(g)[:, None] * S0
    S = Sd + b * torch.outer(k, v - Sd.T @ k)
    o, S_out = run(KR, d, output_final_state=True, scale=0.7)
    assert torch.allclose(S_out[0, 0], S) and torch.allclose(o[0, 0, 0], 0.7 * S.T @ q)


@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_chunk_matches_reference_float64(shape):
    B, T, H, HV, K, V, C = shape
    d = kda_inputs(B, T, H, HV, K, V)
    o, S = run(KC, d, output_final_state=True, chunk_size=C)
    o_ref, S_ref = run(KR, d, output_final_state=True)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(S, S_ref) < 1e-10


@pytest.mark.parametrize("sub", [1, 5, 16, 64])
def test_chunk_sub_blocks_and_strong_decay(sub):
    """Per-step decays down to e^-40 (a chunk's total far past exp's range) stay finite and exact."""
    d = kda_inputs(1, 130, 2, 2, 16, 16, g_scale=40.0)
    o, S = run(KC, d, output_final_state=True, sub_chunk=sub)
    o_ref, S_ref = run(KR, d, output_final_state=True)
    assert torch.isfinite(o).all()
    assert rel_err(o, o_ref) < 1e-10 and rel_err(S, S_ref) < 1e-10


def test_chunk_float32_and_half():
    d = kda_inputs(1, 100, 2, 4, 32, 32)
    o_ref, S_ref = run(KR, d, output_final_state=True)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        dl = {n: x.to(dtype if n != "initial_state" else torch.float32) for n, x in d.items()}
        o, S = run(KC, dl, output_final_state=True)
        assert o.dtype == dtype and S.dtype == torch.float32
        assert rel_err(o, o_ref) < tol and rel_err(S, S_ref) < max(tol, 1e-5)


def test_packed_sequences_match_separate_calls():
    d = kda_inputs(1, 90, 2, 2, 16, 8, N=4)
    cu = torch.tensor([0, 20, 20, 85, 90])
    for mod in (KR, KC):
        o, S = run(mod, d, output_final_state=True, cu_seqlens=cu)
        for n in range(4):
            s, e = int(cu[n]), int(cu[n + 1])
            if e == s:
                assert torch.equal(S[n], d["initial_state"][n])
                continue
            part = {k: (x[:, s:e] if k != "initial_state" else x[n : n + 1]) for k, x in d.items()}
            o_n, S_n = run(KR, part, output_final_state=True)
            assert rel_err(o[:, s:e], o_n) < 1e-10 and rel_err(S[n : n + 1], S_n) < 1e-10


def test_chunk_gradients_match_reference():
    d = kda_inputs(1, 40, 1, 2, 8, 8, requires_grad=True)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    w = torch.randn(1, 40, 2, 8, dtype=torch.float64)
    grads = []
    for mod, kw in ((KC, {"chunk_size": 16}), (KR, {})):
        o, S = run(mod, d, output_final_state=True, **kw)
        loss = (o * w).sum() + S.pow(2).sum()
        grads.append(torch.autograd.grad(loss, [d[n] for n in names]))
    for name, a, b in zip(names, *grads):
        assert rel_err(a, b) < 1e-9, name


def test_check_kda_errors():
    d = kda_inputs(1, 5, 1, 2, 8, 8)
    args = lambda **o: [o.get(n, d[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")]  # noqa: E731
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, HV, K\]"):
        KR.check_kda(*args(g=d["g"][..., 0]), None, None)
    with pytest.raises(ValueError, match="beta"):
        KR.check_kda(*args(beta=None), None, None)
    with pytest.raises(ValueError, match="initial_state"):
        KR.check_kda(*args(initial_state=d["initial_state"][..., :3]), None, None)
    with pytest.raises(TypeError, match="g must be a torch.Tensor"):
        KR.check_kda(*args(g=1.0), None, None)
    assert KR.check_kda(*args(), None, None).HV == 2
    with pytest.raises(ValueError, match="chunk_size"):
        run(KC, d, chunk_size=0)


@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 80), H=st.integers(1, 2), G=st.integers(1, 3),
       K=st.sampled_from([1, 3, 8, 17]), V=st.sampled_from([1, 5, 20]), C=st.integers(1, 40),
       sub=st.integers(1, 20), g_scale=st.sampled_from([0.0, 0.5, 30.0]), state=st.booleans())
def test_chunk_matches_reference_fuzzed_shapes(B, T, H, G, K, V, C, sub, g_scale, state):
    d = kda_inputs(B, T, H, H * G, K, V, g_scale=g_scale)
    if not state:
        d["initial_state"] = None
    o, S = run(KC, d, output_final_state=True, chunk_size=C, sub_chunk=sub)
    o_ref, S_ref = run(KR, d, output_final_state=True)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(S, S_ref) < 1e-10


def test_chunk_gradcheck_float64():
    """torch.autograd.gradcheck through q, k, v, g, beta and the initial state (two chunks, two sub-blocks)."""
    d = kda_inputs(1, 7, 1, 1, 3, 2, requires_grad=True)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def f(*xs):
        return run(KC, dict(zip(names, xs)), output_final_state=True, chunk_size=4, sub_chunk=2)

    assert torch.autograd.gradcheck(f, tuple(d[n] for n in names), eps=1e-6, atol=1e-6, rtol=1e-5)
