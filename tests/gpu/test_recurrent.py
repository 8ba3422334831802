"""The token-recurrent (decode) kernels of the scalar-gate family on the GPU against the float64
recurrence (tier 3, see :mod:`tests.gpu.helpers`): the plain entry points of every member
(:mod:`gdn.ops.delta.triton.recurrent`), packed sequences, the in-kernel L2 norm, the in-place
state pool, the speculative step with its commit and the CUDA-graph decode step
(:mod:`gdn.ops.delta.triton.pool`).

fp32 and bf16 inputs, fp32 state; the reference runs in float64 on the already rounded inputs.
Every state is fp32 arithmetic whatever the inputs, so states are held to ``FP32_TOL``; outputs
of bf16 runs to twice the PyTorch chunk form's error from the same inputs. Outputs are poisoned
with NaN first wherever the API takes a preallocated buffer, so an unwritten element fails, and
pool slots a call must not touch are compared bit for bit.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gdn import ops
from gdn.ops import gates
from gdn.ops.delta import chunk as chunk_form
from gdn.ops.delta import reference
from gdn.ops.delta.triton import pool as P
from gdn.ops.delta.triton import recurrent as R
from gdn.ops.delta.triton import run_recurrent

from .helpers import DEVICE, FP32_TOL, HAS_BETA, HAS_G, assert_within, dtype_id, offsets, rel_err

DTYPES = (torch.float32, torch.bfloat16)
MEMBERS = ("linear_attention", "gated_linear_attention", "delta_rule", "gated_delta_rule")
SHAPES = [  # (B, T, H, HV, K, V): awkward, then the decode benchmark shapes of benchmarks/decode_gpu.py
    (2, 1, 1, 2, 60, 100),
    (3, 5, 2, 4, 100, 64),
    (1, 63, 1, 2, 128, 16),
    (2, 2, 1, 1, 256, 256),
    (1, 1, 16, 32, 128, 128),
    (32, 1, 16, 32, 128, 128),
    (256, 1, 16, 32, 128, 128),
]
#: bf16 bound of outputs that the chunk form cannot produce (in-kernel L2 norm, graph replays): a
#: bf16 rounding of o is ≈ 4e-3, a wrong kernel O(1).
BF16_TOL = 1e-2


def inputs(B, T, H, HV, K, V, dtype, *, N=None, seed=0, device=DEVICE):
    """q, k (unit norm), v in ``dtype``; g ≤ 0 and β ∈ (0, 1) in ``dtype``; an fp32 state [N, HV, K, V]."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device)

    def u(*s):
        return torch.rand(*s, generator=gen, device=device)

    N = B if N is None else N
    return (r(B, T, H, K).to(dtype), F.normalize(r(B, T, H, K), dim=-1).to(dtype), r(B, T, HV, V).to(dtype),
            (-u(B, T, HV) * 0.5).to(dtype), u(B, T, HV).to(dtype), r(N, HV, K, V) * 0.5)


def _member_args(member, q, k, v, g, beta):
    return [q, k, v] + ([g] if HAS_G[member] else []) + ([beta] if HAS_BETA[member] else [])


def ref(member, q, k, v, g, beta, h0, **kw):
    """(o, final state) of the float64 recurrence on the given (rounded) inputs."""
    args = [x.double() for x in _member_args(member, q, k, v, g, beta)]
    return getattr(reference, member)(*args, initial_state=None if h0 is None else h0.double(),
                                      output_final_state=True, **kw)


def o_bound(dtype, member, q, k, v, g, beta, h0, o_ref, **kw):
    """fp32: FP32_TOL; half inputs: 2 × the chunk form's output error from the same inputs."""
    if dtype == torch.float32:
        return FP32_TOL
    o, _ = getattr(chunk_form, member)(*_member_args(member, q, k, v, g, beta), initial_state=h0,
                                       output_final_state=True, **kw)
    return 2 * rel_err(o, o_ref)


def _plain_cases():
    """Every member at the first two shapes, Gated DeltaNet at all."""
    return [pytest.param(shape, member, id="x".join(map(str, shape)) + "-" + member)
            for shape in SHAPES for member in MEMBERS if shape in SHAPES[:2] or member == "gated_delta_rule"]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape,member", _plain_cases())
def test_plain(shape, member, dtype, device=DEVICE):
    q, k, v, g, beta, h0 = inputs(*shape, dtype, seed=sum(shape), device=device)
    with torch.inference_mode():
        o, S = getattr(R, "fused_recurrent_" + member)(*_member_args(member, q, k, v, g, beta), initial_state=h0,
                                                        output_final_state=True)
        o_ref, S_ref = ref(member, q, k, v, g, beta, h0)
        bound = o_bound(dtype, member, q, k, v, g, beta, h0, o_ref)
    assert_within({"o": rel_err(o, o_ref), "S": rel_err(S, S_ref)}, {"o": bound, "S": FP32_TOL},
                  f"fused_recurrent_{member} {shape} {dtype_id(dtype)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_packed(dtype, device=DEVICE):
    """Packed sequences of 1 to 63 tokens, offsets on the device."""
    lens = [1, 5, 63, 2, 1]
    cu = offsets(lens, device)
    q, k, v, g, beta, h0 = inputs(1, sum(lens), 2, 4, 100, 60, dtype, N=len(lens), seed=5, device=device)
    with torch.inference_mode():
        o, S = R.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  cu_seqlens=cu)
        o_ref, S_ref = ref("gated_delta_rule", q, k, v, g, beta, h0, cu_seqlens=cu)
        bound = o_bound(dtype, "gated_delta_rule", q, k, v, g, beta, h0, o_ref, cu_seqlens=cu)
    assert_within({"o": rel_err(o, o_ref), "S": rel_err(S, S_ref)}, {"o": bound, "S": FP32_TOL},
                  f"packed {lens} {dtype_id(dtype)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_l2norm_in_kernel(dtype, device=DEVICE):
    """``use_qk_l2norm``: q and k normalised inside the kernel (keys far from unit norm)."""
    q, k, v, g, beta, h0 = inputs(4, 3, 16, 32, 128, 128, dtype, seed=6, device=device)
    k = (k.float() * 3 + 0.1).to(dtype)
    with torch.inference_mode():
        o, S = R.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm=True)
        qn, kn = (x.double() / torch.sqrt((x.double() ** 2).sum(-1, keepdim=True) + gates.L2NORM_EPS) for x in (q, k))
        o_ref, S_ref = ref("gated_delta_rule", qn, kn, v, g, beta, h0)
    assert_within({"o": rel_err(o, o_ref), "S": rel_err(S, S_ref)},
                  {"o": FP32_TOL if dtype == torch.float32 else BF16_TOL, "S": FP32_TOL},
                  f"use_qk_l2norm {dtype_id(dtype)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("N,P_", [(3, 7), (256, 300)], ids=["N3-P7", "N256-P300"])
def test_pool_in_place(N, P_, dtype, device=DEVICE):
    """The pool updated in place at the given slots; slot −1 is padding (output 0, no state), and
    every other slot keeps its bits."""
    H, HV, K, V = (1, 2, 60, 100) if N == 3 else (16, 32, 128, 128)
    q, k, v, g, beta, _ = inputs(N, 1, H, HV, K, V, dtype, seed=N, device=device)
    gen = torch.Generator(device=device).manual_seed(N + 1)
    pool = torch.randn(P_, HV, K, V, generator=gen, device=device)
    slots = torch.randperm(P_, generator=gen, device=device)[:N].to(torch.int32)
    slots[1] = -1
    before = pool.clone()
    out = torch.full((N, 1, HV, V), float("nan"), dtype=dtype, device=device)
    with torch.inference_mode():
        o = P.fused_recurrent_gated_delta_rule_pool(q, k, v, g, beta, state_pool=pool, slot_indices=slots, out=out)
        live = (slots >= 0).nonzero().squeeze(1)
        used = slots[live].long()
        o_ref, S_ref = ref("gated_delta_rule", q[live], k[live], v[live], g[live], beta[live], before[used])
        bound = o_bound(dtype, "gated_delta_rule", q[live], k[live], v[live], g[live], beta[live], before[used], o_ref)
    touched = torch.zeros(P_, dtype=torch.bool, device=device)
    touched[used] = True
    assert torch.equal(pool[~touched], before[~touched]), "slots outside slot_indices changed"
    assert not torch.any(o[1] != 0), "the padding entry's output is not zero"
    assert_within({"o": rel_err(o[live], o_ref), "S": rel_err(pool[used], S_ref)}, {"o": bound, "S": FP32_TOL},
                  f"pool N={N} P={P_} {dtype_id(dtype)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_spec_states_and_commit(dtype, device=DEVICE):
    """The speculative step keeps the state after every token and leaves the pool alone; the commit
    writes each sequence's state after its accepted tokens (none for 0 accepted)."""
    N, T, H, HV, K, V, P_ = 32, 4, 16, 32, 128, 128, 40
    q, k, v, g, beta, _ = inputs(N, T, H, HV, K, V, dtype, seed=7, device=device)
    gen = torch.Generator(device=device).manual_seed(8)
    pool = torch.randn(P_, HV, K, V, generator=gen, device=device)
    slots = torch.randperm(P_, generator=gen, device=device)[:N].to(torch.int32)
    before = pool.clone()
    with torch.inference_mode():
        o, states = P.fused_recurrent_gated_delta_rule_spec(q, k, v, g, beta, state_pool=pool, slot_indices=slots)
        assert torch.equal(pool, before), "the speculative step wrote to the pool"
        h0 = before[slots.long()]
        errs = {}
        for i in range(T):
            head = slice(0, i + 1)
            _, S_i = ref("gated_delta_rule", q[:, head], k[:, head], v[:, head], g[:, head], beta[:, head], h0)
            errs[f"S{i}"] = rel_err(states[:, i], S_i)
        o_ref, _ = ref("gated_delta_rule", q, k, v, g, beta, h0)
        errs["o"] = rel_err(o, o_ref)
        bounds = {key: FP32_TOL for key in errs}
        bounds["o"] = o_bound(dtype, "gated_delta_rule", q, k, v, g, beta, h0, o_ref)
        accepted = torch.randint(0, T + 1, (N,), generator=gen, device=device, dtype=torch.int32)
        accepted[:2] = torch.tensor([0, T], dtype=torch.int32)
        P.commit_spec_states(pool, slots, states, accepted)
    want = before.clone()
    keep = accepted > 0
    want[slots[keep].long()] = states[keep.nonzero().squeeze(1), accepted[keep].long() - 1]
    assert torch.equal(pool, want), "commit_spec_states wrote other states than the accepted ones"
    assert_within(errs, bounds, f"spec N={N} T={T} {dtype_id(dtype)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_decode_graph(dtype, device=DEVICE):
    """Capturing :class:`DecodeGraph` leaves the pool untouched; three replays on new inputs follow
    the recurrence step by step."""
    N, H, HV, K, V, P_ = 8, 16, 32, 128, 128, 16
    gen = torch.Generator(device=device).manual_seed(9)
    pool = torch.randn(P_, HV, K, V, generator=gen, device=device)
    before = pool.clone()
    graph = P.DecodeGraph(pool, N, H, dtype=dtype)
    assert torch.equal(pool, before), "graph capture changed the pool"
    slots = torch.randperm(P_, generator=gen, device=device)[:N].to(torch.int32)
    S = before[slots.long()].double()
    errs = {}
    for step in range(3):
        q, k, v, g, beta, _ = inputs(N, 1, H, HV, K, V, dtype, seed=10 + step, device=device)
        o = graph(q, k, v, g, beta, slot_indices=slots).clone()
        with torch.inference_mode():
            o_ref, S = ref("gated_delta_rule", q, k, v, g, beta, S)
        errs[f"o{step}"] = rel_err(o, o_ref)
    errs["S"] = rel_err(pool[slots.long()], S)
    bounds = {key: FP32_TOL if dtype == torch.float32 or key == "S" else BF16_TOL for key in errs}
    assert_within(errs, bounds, f"DecodeGraph N={N} {dtype_id(dtype)}")


@pytest.mark.parametrize("T", [1, 64])
def test_public_op_takes_the_recurrent_kernel(T, device=DEVICE):
    """Without gradients and at most ``RECURRENT_MAX_T`` tokens, ``backend="triton"`` runs the
    token-recurrent kernel: the op's result is that kernel's, bit for bit."""
    q, k, v, g, beta, h0 = inputs(2, T, 2, 4, 64, 64, torch.bfloat16, seed=T, device=device)
    with torch.inference_mode():
        o, S = ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="triton")
        o_k, S_k = run_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o_k) and torch.equal(S, S_k)
