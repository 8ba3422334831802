"""Tier 1 (DESIGN §5): the token-by-token recurrences against closed parallel forms, in float64."""
from __future__ import annotations

import math

import pytest
import torch

from gdn.ops.attention import softmax_attention_naive
from gdn.ops.delta import reference as R

from .helpers import MEMBERS, call, make_inputs, rel_err


def _per_head(d, H, HV):
    """Expand q/k to the value heads and return [B, HV, T, D] views for matrix algebra."""
    G = HV // H
    q = d["q"].repeat_interleave(G, dim=2).transpose(1, 2)
    k = d["k"].repeat_interleave(G, dim=2).transpose(1, 2)
    v = d["v"].transpose(1, 2)
    return q, k, v, d["g"].transpose(1, 2), d["beta"].transpose(1, 2)


def _closed_form(member, d, H, HV, scale):
    """o (and final state) from the closed parallel forms of DESIGN §5 tier 1, with S0 = 0:
    linear attention ``(Q Kᵀ ⊙ M) V``; gated ``(Q Kᵀ ⊙ D) V`` with ``D_ij = exp(γ_i − γ_j)``;
    delta members ``(Q Kᵀ ⊙ D)(I + diag(β)(K Kᵀ ⊙ D⁻))⁻¹ diag(β) V`` (D⁻ strictly lower)."""
    q, k, v, g, beta = _per_head(d, H, HV)
    T = q.shape[2]
    M = torch.ones(T, T, dtype=q.dtype).tril()
    if member in ("gated_linear_attention", "gated_delta_rule"):
        gam = g.cumsum(-1)
        D = torch.exp((gam[..., :, None] - gam[..., None, :]).masked_fill(M == 0, -math.inf))
    else:
        gam = torch.zeros_like(g)
        D = M.expand(q.shape[0], q.shape[1], T, T)
    if member in ("delta_rule", "gated_delta_rule"):
        A = torch.diag_embed(beta) @ ((k @ k.transpose(-1, -2)) * D.tril(-1))
        U = torch.linalg.solve(torch.eye(T, dtype=q.dtype) + A, beta[..., None] * v)  # the written values δ
    else:
        U = v
    o = scale * ((q @ k.transpose(-1, -2)) * D) @ U
    # final state: Σ_j exp(γ_T − γ_j) k_j δ_jᵀ
    w = torch.exp(gam[..., -1:] - gam)
    S = (k * w[..., None]).transpose(-1, -2) @ U
    return o.transpose(1, 2), S


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("shape", [(2, 1, 1, 1, 4, 4), (2, 17, 2, 4, 8, 6), (1, 40, 1, 3, 5, 7)])
def test_reference_matches_closed_form(member, shape):
    B, T, H, HV, K, V = shape
    d = make_inputs(B, T, H, HV, K, V, state=False)
    scale = 0.7
    o, S = call(R, member, d, scale=scale, output_final_state=True)
    o_ref, S_ref = _closed_form(member, d, H, HV, scale)
    assert rel_err(o, o_ref) < 1e-12
    assert rel_err(S, S_ref) < 1e-12


@pytest.mark.parametrize("member", ["linear_attention", "gated_linear_attention"])
def test_initial_state_term_of_the_linear_members(member):
    """With S0 ≠ 0 the linear members add ``diag(exp(γ)) Q S0`` (scaled) to the closed form."""
    B, T, H, K, V = 1, 12, 2, 5, 3
    d = make_inputs(B, T, H, H, K, V)
    o, _ = call(R, member, d, scale=1.0)
    o0, _ = call(R, member, {**d, "initial_state": None}, scale=1.0)
    gam = d["g"].cumsum(1) if member == "gated_linear_attention" else torch.zeros_like(d["g"])
    extra = torch.einsum("bthk,bhkv->bthv", d["q"], d["initial_state"]) * torch.exp(gam)[..., None]
    assert rel_err(o - o0, extra) < 1e-12


def test_grouped_value_heads_read_their_qk_head():
    """Value head j reads q/k head j // (HV // H): same as repeating q and k explicitly."""
    d = make_inputs(2, 9, 2, 6, 4, 5)
    o, S = R.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                              output_final_state=True)
    rep = {**d, "q": d["q"].repeat_interleave(3, 2), "k": d["k"].repeat_interleave(3, 2)}
    o2, S2 = R.gated_delta_rule(rep["q"], rep["k"], rep["v"], rep["g"], rep["beta"],
                                initial_state=rep["initial_state"], output_final_state=True)
    assert rel_err(o, o2) < 1e-14 and rel_err(S, S2) < 1e-14


def test_reference_is_dtype_preserving():
    d = make_inputs(1, 5, 1, 1, 4, 4, dtype=torch.float16)
    o, S = R.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], output_final_state=True)
    assert o.dtype == torch.float16 and S.dtype == torch.float32
    d64 = make_inputs(1, 5, 1, 1, 4, 4)
    o, S = R.gated_delta_rule(d64["q"], d64["k"], d64["v"], d64["g"], d64["beta"], output_final_state=True)
    assert o.dtype == torch.float64 and S.dtype == torch.float64


def _softmax_rows(q, k, v, scale, allowed):
    """Row by row: o_t = Σ_s softmax_s(q_t·k_s) v_s over the allowed keys (one head)."""
    out = torch.zeros(q.shape[0], v.shape[1], dtype=q.dtype)
    for t in range(q.shape[0]):
        s = allowed(t)
        w = torch.softmax(scale * k[s] @ q[t], dim=0)
        out[t] = w @ v[s]
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_softmax_reference_matches_row_by_row(window):
    gen = torch.Generator().manual_seed(0)
    T, HQ, HKV, K, V = 11, 4, 2, 6, 5
    q = torch.randn(1, T, HQ, K, generator=gen, dtype=torch.float64)
    k = torch.randn(1, T, HKV, K, generator=gen, dtype=torch.float64)
    v = torch.randn(1, T, HKV, V, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 4, 11])
    o = softmax_attention_naive(q, k, v, window_size=window, cu_seqlens=cu)
    W = window or T
    for h in range(HQ):
        def allowed(t):
            start = 0 if t < 4 else 4
            return list(range(max(start, t - W + 1), t + 1))

        exp = _softmax_rows(q[0, :, h], k[0, :, h // 2], v[0, :, h // 2], K ** -0.5, allowed)
        assert rel_err(o[0, :, h], exp) < 1e-12
