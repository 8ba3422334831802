"""Tier 3 on the CPU (DESIGN §5): the fused recurrent Triton kernels under the Triton interpreter
against the reference recurrence: plain op (every member), packed sequences, in-kernel L2 norm,
the in-place state pool, the speculative step and its commit, and argument validation.

The interpreter proves the indexing and the math; the GPU check (tests/gpu/test_recurrent.py)
proves the compiled kernels.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from gdn.ops.delta import reference as R  # noqa: E402
from gdn.ops.delta.triton import recurrent as FR  # noqa: E402
from gdn.ops.delta.triton import pool as RP  # noqa: E402

from .helpers import HAS_BETA, HAS_G, MEMBERS, make_inputs, rel_err  # noqa: E402

DTYPES = (torch.float32, torch.float16)
# fp32 inputs: fp32 arithmetic vs the float64 recurrence. fp16: the output is rounded to fp16.
TOL_O = {torch.float32: 1e-5, torch.float16: 2e-3}
TOL_S = 1e-5


def _ref(member, d, **kw):
    """The float64 reference on the same (already rounded) inputs."""
    args = [d["q"], d["k"], d["v"]] + ([d["g"]] if HAS_G[member] else []) + ([d["beta"]] if HAS_BETA[member] else [])
    args = [a.double() for a in args]
    h0 = d.get("initial_state")
    return getattr(R, member)(*args, initial_state=None if h0 is None else h0.double(), output_final_state=True, **kw)


def _fused(member, d, **kw):
    args = [d["q"], d["k"], d["v"]] + ([d["g"]] if HAS_G[member] else []) + ([d["beta"]] if HAS_BETA[member] else [])
    return getattr(FR, "fused_recurrent_" + member)(*args, initial_state=d.get("initial_state"), **kw)


def _gdr_args(d):
    return d["q"], d["k"], d["v"], d["g"], d["beta"]


SHAPES = [  # (B, T, H, HV, K, V)
    (2, 1, 1, 2, 16, 16),
    (1, 5, 1, 2, 60, 100),
    (1, 2, 2, 4, 64, 60),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(member, shape, dtype):
    B, T, H, HV, K, V = shape
    d = make_inputs(B, T, H, HV, K, V, dtype=dtype, state=(T != 1 or K != 16))
    o, S = _fused(member, d, output_final_state=True)
    o_ref, S_ref = _ref(member, d)
    assert o.dtype == dtype and S.dtype == torch.float32 and S.shape == (B, HV, K, V)
    assert rel_err(o, o_ref) < TOL_O[dtype]
    assert rel_err(S, S_ref) < TOL_S
    o2, S2 = _fused(member, d)
    assert S2 is None and torch.equal(o2, o)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_sequences(dtype):
    lens = [1, 5, 2]
    cu = torch.tensor([0, 1, 6, 8], dtype=torch.int32)
    d = make_inputs(1, sum(lens), 1, 2, 60, 16, dtype=dtype, N=len(lens))
    o, S = FR.fused_recurrent_gated_delta_rule(*_gdr_args(d), initial_state=d["initial_state"],
                                               output_final_state=True, cu_seqlens=cu)
    o_ref, S_ref = _ref("gated_delta_rule", d, cu_seqlens=cu)
    assert rel_err(o, o_ref) < TOL_O[dtype]
    assert rel_err(S, S_ref) < TOL_S


def test_qk_l2norm_in_kernel():
    d = make_inputs(2, 3, 1, 2, 60, 16, dtype=torch.float32)
    d["k"] = d["k"] * 3.0 + 0.1  # not unit-norm: the kernel must normalise both q and k
    o, S = FR.fused_recurrent_gated_delta_rule(*_gdr_args(d), initial_state=d["initial_state"],
                                               output_final_state=True, use_qk_l2norm=True)
    n = {**d}
    for name in ("q", "k"):
        x = d[name].double()
        n[name] = x / torch.sqrt((x * x).sum(-1, keepdim=True) + FR.L2NORM_EPS)
    o_ref, S_ref = _ref("gated_delta_rule", n)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


def test_strided_inputs_and_scale():
    """q, k, v as views of one fused projection (strided tokens), an explicit scale."""
    B, T, H, HV, K, V = 2, 3, 1, 2, 16, 16
    d = make_inputs(B, T, H, HV, K, V, dtype=torch.float32)
    fused = torch.cat([d["q"].flatten(2), d["k"].flatten(2), d["v"].flatten(2)], dim=-1)
    q, k, v = fused.split([H * K, H * K, HV * V], dim=-1)
    q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, V)
    assert not q.is_contiguous()
    o, S = FR.fused_recurrent_gated_delta_rule(q, k, v, d["g"], d["beta"], scale=0.3,
                                               initial_state=d["initial_state"], output_final_state=True)
    o_ref, S_ref = _ref("gated_delta_rule", d, scale=0.3)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


def _pool_setup(dtype, N=3, P=5, T=1, H=1, HV=2, K=60, V=16):
    d = make_inputs(N, T, H, HV, K, V, dtype=dtype)
    pool = torch.randn(P, HV, K, V, dtype=torch.float32)
    return d, pool


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slot_dtype", (torch.int32, torch.int64), ids=str)
def test_pool_in_place(dtype, slot_dtype):
    d, pool = _pool_setup(dtype, T=2)
    slots = torch.tensor([3, -1, 0], dtype=slot_dtype)
    before = pool.clone()
    o = RP.fused_recurrent_gated_delta_rule_pool(*_gdr_args(d), state_pool=pool, slot_indices=slots)
    live = torch.tensor([0, 2])
    d_live = {name: x[live] for name, x in d.items() if x is not None}
    d_live["initial_state"] = before[[3, 0]]
    o_ref, S_ref = _ref("gated_delta_rule", d_live)
    assert rel_err(o[live], o_ref) < TOL_O[dtype]
    assert torch.count_nonzero(o[1]) == 0  # padding entry: zeros
    assert rel_err(pool[[3, 0]], S_ref) < TOL_S
    untouched = [1, 2, 4]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("l2norm", [False, True], ids=["plain", "l2norm"])
def test_step_in_place_equals_plain_kernel(member, l2norm):
    """fused_recurrent_step_ (the state batch updated in place, what the static decode step runs):
    the plain kernel's o and final state bit for bit, in the state's own storage."""
    d = make_inputs(3, 1, 1, 2, 60, 16, dtype=torch.float32)
    g = d["g"] if HAS_G[member] else None
    beta = d["beta"] if HAS_BETA[member] else None
    o_ref, S_ref = FR.fused_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], g, beta,
                                                       initial_state=d["initial_state"], output_final_state=True,
                                                       use_qk_l2norm=l2norm)
    state = d["initial_state"].clone()
    ptr = state.data_ptr()
    o = RP.fused_recurrent_step_(d["q"], d["k"], d["v"], g, beta, state, use_qk_l2norm=l2norm)
    assert torch.equal(o, o_ref) and torch.equal(state, S_ref) and state.data_ptr() == ptr
    with pytest.raises(ValueError, match="contiguous"):
        strided = S_ref.transpose(-1, -2).contiguous().transpose(-1, -2)
        RP.fused_recurrent_step_(d["q"], d["k"], d["v"], g, beta, strided)
    with pytest.raises(ValueError, match="state must have shape"):
        RP.fused_recurrent_step_(d["q"], d["k"], d["v"], g, beta, state[:2].clone())


def test_pool_packed_and_members():
    """Packed one-token-or-more sequences on the pool, no gate (delta_rule) and no delta (GLA)."""
    cu = torch.tensor([0, 2, 3, 6])
    for member in ("delta_rule", "gated_linear_attention"):
        d = make_inputs(1, 6, 1, 2, 16, 60, dtype=torch.float32, N=3)
        pool = torch.randn(4, 2, 16, 60)
        before = pool.clone()
        slots = torch.tensor([1, 3, -1])
        g = d["g"] if HAS_G[member] else None
        beta = d["beta"] if HAS_BETA[member] else None
        o = RP.fused_recurrent_gated_delta_rule_pool(d["q"], d["k"], d["v"], g, beta, state_pool=pool,
                                                     slot_indices=slots, cu_seqlens=cu)
        d_ref = {**d, "initial_state": torch.stack([before[1], before[3], torch.zeros_like(before[0])])}
        o_ref, S_ref = _ref(member, d_ref, cu_seqlens=cu)
        assert rel_err(o[:, :3], o_ref[:, :3]) < 1e-5
        assert torch.count_nonzero(o[:, 3:]) == 0
        assert rel_err(pool[[1, 3]], S_ref[:2]) < 1e-5
        assert torch.equal(pool[[0, 2]], before[[0, 2]])


def test_pool_repeated_decode_equals_prefill():
    """T decode steps on the pool equal one T-token pass of the reference."""
    d, pool = _pool_setup(torch.float32, N=2, P=3, T=4)
    slots = torch.tensor([2, 0])
    d["initial_state"] = pool[[2, 0]].clone()
    o_ref, S_ref = _ref("gated_delta_rule", d)
    outs = []
    for t in range(4):
        outs.append(RP.fused_recurrent_gated_delta_rule_pool(
            *(x[:, t:t + 1] for x in _gdr_args(d)), state_pool=pool, slot_indices=slots))
    assert rel_err(torch.cat(outs, 1), o_ref) < 1e-5
    assert rel_err(pool[[2, 0]], S_ref) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_spec_states_equal_token_by_token(dtype):
    B, T, H, HV, K, V = 2, 5, 1, 2, 60, 16
    d = make_inputs(B, T, H, HV, K, V, dtype=dtype)
    o, states = RP.fused_recurrent_gated_delta_rule_spec(*_gdr_args(d), initial_state=d["initial_state"])
    assert states.shape == (B, T, HV, K, V)
    o_plain, _ = FR.fused_recurrent_gated_delta_rule(*_gdr_args(d), initial_state=d["initial_state"])
    assert torch.equal(o, o_plain)
    for t in range(T):
        prefix = {name: (x if name == "initial_state" else x[:, : t + 1]) for name, x in d.items()}
        _, S_t = _ref("gated_delta_rule", prefix)
        assert rel_err(states[:, t], S_t) < TOL_S


def test_spec_from_pool_then_commit():
    N, T, P = 3, 3, 4
    d, pool = _pool_setup(torch.float32, N=N, P=P, T=T)
    slots = torch.tensor([2, 0, -1])
    before = pool.clone()
    buf = torch.empty(N, T, 2, 60, 16)
    o, states = RP.fused_recurrent_gated_delta_rule_spec(*_gdr_args(d), state_pool=pool, slot_indices=slots,
                                                        intermediate_states=buf)
    assert states.data_ptr() == buf.data_ptr()
    assert torch.equal(pool, before)  # the speculative step never writes the pool
    assert torch.count_nonzero(o[2]) == 0
    ref_in = {**d, "initial_state": torch.stack([before[2], before[0], torch.zeros_like(before[0])])}
    for t in range(T):
        _, S_t = _ref("gated_delta_rule", {n: (x if n == "initial_state" else x[:, : t + 1]) for n, x in ref_in.items()})
        assert rel_err(states[:2, t], S_t[:2]) < TOL_S
    accepted = torch.tensor([2, 0, 3], dtype=torch.int32)
    RP.commit_spec_states(pool, slots, states, accepted)
    assert torch.equal(pool[2], states[0, 1])  # two tokens accepted: state after token 1
    assert torch.equal(pool[0], before[0])     # none accepted: unchanged
    assert torch.equal(pool[[1, 3]], before[[1, 3]])  # padding entry and free slots untouched


def test_spec_packed_commit():
    cu = torch.tensor([0, 3, 4])
    d = make_inputs(1, 4, 1, 2, 16, 16, dtype=torch.float32, N=2)
    o, states = RP.fused_recurrent_gated_delta_rule_spec(*_gdr_args(d), initial_state=d["initial_state"],
                                                        cu_seqlens=cu)
    assert states.shape == (1, 4, 2, 16, 16)
    _, S2 = _ref("gated_delta_rule", {**d, **{n: d[n][:, :2] for n in ("q", "k", "v", "g", "beta")},
                                      "initial_state": d["initial_state"][:1]})
    assert rel_err(states[0, 1], S2[0]) < TOL_S
    pool = torch.zeros(2, 2, 16, 16)
    RP.commit_spec_states(pool, torch.tensor([1, 0]), states, torch.tensor([2, 1]), cu_seqlens=cu)
    assert torch.equal(pool[1], states[0, 1]) and torch.equal(pool[0], states[0, 3])


def test_inference_only():
    d = make_inputs(1, 1, 1, 1, 16, 16, dtype=torch.float32, requires_grad=True)
    with pytest.raises(ValueError, match="q requires grad.*inference-only"):
        FR.fused_recurrent_gated_delta_rule(*_gdr_args(d), initial_state=d["initial_state"])
    with torch.no_grad():
        o, _ = FR.fused_recurrent_gated_delta_rule(*_gdr_args(d), initial_state=d["initial_state"])
    assert not o.requires_grad


def test_validation_errors():
    d, pool = _pool_setup(torch.float32)
    args = _gdr_args(d)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="state_pool must have shape"):
        RP.fused_recurrent_gated_delta_rule_pool(*args, state_pool=pool[:, :1], slot_indices=slots)
    with pytest.raises(TypeError, match="state_pool must be float32"):
        RP.fused_recurrent_gated_delta_rule_pool(*args, state_pool=pool.half(), slot_indices=slots)
    with pytest.raises(ValueError, match="state_pool must be contiguous"):
        RP.fused_recurrent_gated_delta_rule_pool(*args, state_pool=pool.transpose(2, 3).contiguous().transpose(2, 3),
                                                 slot_indices=slots)
    with pytest.raises(TypeError, match="slot_indices must be int32 or int64"):
        RP.fused_recurrent_gated_delta_rule_pool(*args, state_pool=pool, slot_indices=slots.float())
    with pytest.raises(ValueError, match=r"slot_indices must have shape \[N\] = \[3\]"):
        RP.fused_recurrent_gated_delta_rule_pool(*args, state_pool=pool, slot_indices=slots[:2])
    with pytest.raises(ValueError, match="must be < pool size 5"):
        RP.fused_recurrent_gated_delta_rule_pool(*args, state_pool=pool, slot_indices=torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match="must not repeat"):
        RP.fused_recurrent_gated_delta_rule_pool(*args, state_pool=pool, slot_indices=torch.tensor([1, 1, -1]))
    with pytest.raises(ValueError, match="out must be"):
        RP.fused_recurrent_gated_delta_rule_pool(*args, state_pool=pool, slot_indices=slots,
                                                 out=torch.empty(3, 1, 2, 15))
    with pytest.raises(ValueError, match="not both"):
        RP.fused_recurrent_gated_delta_rule_spec(*args, initial_state=d["initial_state"], state_pool=pool,
                                                 slot_indices=slots)
    with pytest.raises(ValueError, match="go together"):
        RP.fused_recurrent_gated_delta_rule_spec(*args, state_pool=pool)
    with pytest.raises(ValueError, match="intermediate_states must be"):
        RP.fused_recurrent_gated_delta_rule_spec(*args, intermediate_states=torch.empty(3, 1, 2, 60, 15))
    with pytest.raises(TypeError, match="float64"):
        FR.fused_recurrent_gated_delta_rule(*(x.double() for x in args))
    with pytest.raises(ValueError, match="K, V <= 256"):
        q = torch.randn(1, 1, 1, 300)
        FR.fused_recurrent_linear_attention(q, q, torch.randn(1, 1, 1, 4))
    with pytest.raises(ValueError, match="initial_state must have shape"):
        FR.fused_recurrent_gated_delta_rule(*args, initial_state=pool)
    with pytest.raises(ValueError, match="accepted_len must have shape"):
        RP.commit_spec_states(pool, slots, torch.zeros(3, 1, 2, 60, 16), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        FR.fused_recurrent_gated_delta_rule(*(x[:1] for x in args), cu_seqlens=torch.tensor([1, 1]))
