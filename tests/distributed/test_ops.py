"""The context-parallel recurrent ops equal the one-process ops (tier 2 of docs/DESIGN.md §6).

On 2 and 4 gloo processes, for every member of the delta family, the fused Gated DeltaNet entry
point and KDA: outputs, final states and the gradients of every input, the initial state and the
gate parameters equal those of the one-process op on the whole sequence (fp64 to 1e-10, fp32 to
1e-5), for batch rows split across ranks and for packed sequences that cross one or several rank
boundaries, end exactly on one, are one token long or empty (also at a boundary and at the end),
on even and uneven slices.
"""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from gdn import ops
from gdn.distributed import ContextParallel, recurrent

from ..ops.helpers import rel_err
from .helpers import spawn

MEMBERS = ("linear_attention", "gated_linear_attention", "delta_rule", "gated_delta_rule", "gated_delta_rule_fused",
           "kimi_delta_attention")
#: Per-token inputs of each member after q, k, v.
GATES = {"linear_attention": (), "gated_linear_attention": ("g",), "delta_rule": ("beta",),
         "gated_delta_rule": ("g", "beta"), "gated_delta_rule_fused": ("a", "b"), "kimi_delta_attention": ("g", "beta")}

T_TOTAL = 150
#: (name, cu_seqlens or None, batch rows)
LAYOUTS = [
    ("rows", None, 2),
    # [0,5) | empty at 5 | [5,38) ends on the 4-way boundary | one token | [39,120) crosses 75/76 and 113 |
    # [120,150) | empty at the end
    ("packed", [0, 5, 5, 38, 39, 120, 150, 150], 1),
    # one sequence over every rank, an empty one on the 2-way boundary, a one-token one at the end
    ("long", [0, 75, 75, 149, 150], 1),
]


def _inputs(member, B, N, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    H, HV, K, V = 2, 4, 12, 10

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    d = {"q": r(B, T_TOTAL, H, K), "v": r(B, T_TOTAL, HV, V)}
    k = r(B, T_TOTAL, H, K)
    d["k"] = k if member == "gated_delta_rule_fused" else torch.nn.functional.normalize(k, dim=-1)
    if member == "kimi_delta_attention":
        d["g"] = -torch.rand(B, T_TOTAL, HV, K, generator=gen, dtype=torch.float64) * 0.3
    else:
        d["g"] = -torch.rand(B, T_TOTAL, HV, generator=gen, dtype=torch.float64) * 0.3
    d["beta"] = torch.rand(B, T_TOTAL, HV, generator=gen, dtype=torch.float64)
    d["a"], d["b"] = r(B, T_TOTAL, HV), r(B, T_TOTAL, HV)
    params = {"A_log": r(HV) * 0.3, "dt_bias": r(HV) * 0.3}
    state = r(N, HV, K, V) * 0.5
    do, dS = r(B, T_TOTAL, HV, V), r(N, HV, K, V)
    cast = {n: x.to(dtype) for n, x in d.items()}
    return cast, {n: p.to(dtype) for n, p in params.items()}, state.to(dtype), do.to(dtype), dS.to(dtype)


def _run(fn_ops, member, tok, params, state, cu, cp=None):
    args = [tok["q"], tok["k"], tok["v"]] + [tok[n] for n in GATES[member]]
    if member == "gated_delta_rule_fused":
        args += [params["A_log"], params["dt_bias"]]
    kw = dict(initial_state=state, output_final_state=True)
    if cp is None:
        kw["cu_seqlens"] = cu
    else:
        kw["cp"] = cp
    return getattr(fn_ops, member)(*args, **kw)


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _check_all(rank, world, dtype, tol, members, bounds_kind):
    group = dist.group.WORLD
    failures = []
    for lname, cu, B in LAYOUTS:
        N = B if cu is None else len(cu) - 1
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        if bounds_kind == "even":
            cp = ContextParallel.split(group, T_TOTAL, cu)
        else:  # uneven: the last rank holds a short slice
            cut = [0] + [round(T_TOTAL * (r + 1) * 0.9 / world) for r in range(world - 1)] + [T_TOTAL]
            cp = ContextParallel(group, cut, cu)
        for member in members:
            tok, params, state, do, dS = _inputs(member, B, N, dtype, seed=zlib.crc32(f"{lname}{member}".encode()))
            # the one-process reference on the whole sequence
            ref_in = {n: _leaf(x) for n, x in tok.items()}
            ref_p = {n: _leaf(x) for n, x in params.items()}
            ref_s = _leaf(state)
            o_ref, S_ref = _run(ops, member, ref_in, ref_p, ref_s, cu_t)
            ((o_ref * do).sum() + (S_ref * dS).sum()).backward()
            # this rank's slice
            mine = {n: _leaf(cp.shard(x)) for n, x in tok.items()}
            my_p = {n: _leaf(x) for n, x in params.items()}
            my_s = _leaf(state)
            o, S = _run(recurrent, member, mine, my_p, my_s, None, cp=cp)
            ((o * cp.shard(do)).sum() + (S * dS).sum()).backward()
            errors = {"o": rel_err(o, cp.shard(o_ref))}
            S_all = S.detach().clone()
            dist.all_reduce(S_all)
            errors["final state"] = rel_err(S_all, S_ref)
            for n in ("q", "k", "v") + GATES[member]:
                errors[f"d{n}"] = rel_err(mine[n].grad, cp.shard(ref_in[n].grad))
            replicated = [("initial_state", my_s, ref_s)]
            if member == "gated_delta_rule_fused":
                replicated += [(n, my_p[n], ref_p[n]) for n in params]
            for n, x, ref in replicated:
                g = x.grad.clone() if x.grad is not None else torch.zeros_like(x)
                dist.all_reduce(g)
                errors[f"d{n}"] = rel_err(g, ref.grad)
            failures += [f"{member} {lname} {bounds_kind} {dtype} rank {rank}/{world}: {name} error {e:.2e}"
                         for name, e in errors.items() if not e < tol]
    return failures


def _worker(rank, world, cases):
    """Every rank checks every case ``(dtype, tol, members, slices)``, then all ranks fail together
    with every rank's failures."""
    mine = [f for dtype, tol, members, kind in cases for f in _check_all(rank, world, dtype, tol, members, kind)]
    failures = [None] * world
    dist.all_gather_object(failures, mine)
    failures = [f for per_rank in failures for f in per_rank]
    assert not failures, "\n".join(failures)


def test_two_processes():
    """2 processes: every member in fp64 to 1e-10 on even slices; Gated DeltaNet and KDA in fp32 to 1e-5."""
    spawn(_worker, 2, [(torch.float64, 1e-10, MEMBERS, "even"),
                       (torch.float32, 1e-5, ("gated_delta_rule", "kimi_delta_attention"), "even")])


@pytest.mark.slow  # four processes on two cores: `make test-all`
def test_four_processes():
    """4 processes: every member in fp64 to 1e-10, even and uneven slices (the last rank short), so
    one sequence crosses three boundaries and the maps compose over several ranks."""
    spawn(_worker, 4, [(torch.float64, 1e-10, MEMBERS, "even"), (torch.float64, 1e-10, MEMBERS, "uneven")])
