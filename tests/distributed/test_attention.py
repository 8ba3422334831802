"""Global softmax attention over a split sequence, ring and all-gather, equals the one-process op
(tier 2 of docs/DESIGN.md §6).

On 2 and 4 gloo processes: outputs and the gradients of q, k and v of
:func:`gdn.distributed.attention.softmax_attention` with ``attention="ring"`` and ``"gather"``
equal :func:`gdn.ops.softmax_attention` on the whole sequence (fp64 to 1e-10, fp32 to 1e-5), for
batch rows, grouped query heads, packed sequences that cross one or several rank boundaries, lie
inside one slice, are one token long or empty, on even and uneven slices, with query chunks small
enough that a block takes several (a wrong merge of partial softmaxes is off by O(1)). The ring's
schedule skips the blocks no query of a rank can see; a model with global attention layers gives
the one-process loss and gradients; the ring keeps only this rank's keys and values for the
backward while the all-gather keeps every earlier rank's.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gdn import ops
from gdn.distributed import ContextParallel
from gdn.distributed import attention as cp_attention
from gdn.models import GDNConfig, GDNForCausalLM

from ..ops.helpers import rel_err
from .helpers import saved_bytes, spawn

T_TOTAL = 96
#: (name, cu_seqlens or None, batch rows)
LAYOUTS = [
    ("rows", None, 2),
    # [0,10) | empty | one token | [11,70) crosses 24, 48 (and 55 uneven) | [70,96) from inside a slice to the end
    ("packed", [0, 10, 10, 11, 70, 96], 1),
    # sequences that each end at or before the next slice boundary: the ring passes nothing on at 4 ranks
    ("short", [0, 24, 30, 48, 72, 96], 1),
]


def _inputs(B, dtype, seed, HQ=4, HKV=2, D=8, Dv=6):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T_TOTAL, h, D, generator=gen, dtype=torch.float64) for h in (HQ, HKV))
    v = torch.randn(B, T_TOTAL, HKV, Dv, generator=gen, dtype=torch.float64)
    do = torch.randn(B, T_TOTAL, HQ, Dv, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, do)]


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _check_op(rank, world, dtype, tol):
    failures = []
    for lname, cu, B in LAYOUTS:
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        q, k, v, do = _inputs(B, dtype, seed=len(lname))
        ref = [_leaf(x) for x in (q, k, v)]
        o_ref = ops.softmax_attention(*ref, causal=True, cu_seqlens=cu_t, scale=0.3)
        (o_ref * do).sum().backward()
        uneven = [0] + [round(T_TOTAL * (r + 1) * 0.85 / world) for r in range(world - 1)] + [T_TOTAL]
        for mode in ("ring", "gather"):
            for kind, cp in (("even", ContextParallel.split(dist.group.WORLD, T_TOTAL, cu, attention=mode)),
                             ("uneven", ContextParallel(dist.group.WORLD, uneven, cu, attention=mode))):
                mine = [_leaf(cp.shard(x)) for x in (q, k, v)]
                o = cp_attention.softmax_attention(*mine, cp=cp, scale=0.3)
                (o * cp.shard(do)).sum().backward()
                errors = {"o": rel_err(o, cp.shard(o_ref))}
                errors.update({f"d{n}": rel_err(x.grad, cp.shard(r.grad)) for n, x, r in zip("qkv", mine, ref)})
                failures += [f"{mode} {lname} {kind} {dtype} rank {rank}/{world}: {n} error {e:.2e}"
                             for n, e in errors.items() if not e < tol]
    return failures


def _check_plan(rank, world):
    """The schedule: rows read every earlier block; packed rows only the blocks from the start of a
    rank's first sequence (known by hand for these layouts)."""
    failures = []
    for cu, want in ((None, {2: [(0, 1, 1), (1, 0, 1)], 4: [(0, 1, 3), (1, 2, 3), (2, 3, 3), (3, 0, 3)]}),
                     # [11, 70) spans ranks 0-2 of 4; rank 3 starts inside [70, 96), which begins on rank 2
                     (LAYOUTS[1][1], {2: [(0, 1, 1), (1, 0, 1)], 4: [(0, 1, 2), (1, 2, 2), (2, 1, 3), (1, 0, 3)]}),
                     # every slice starts a sequence: nothing travels
                     (LAYOUTS[2][1], {2: [(0, 0, 0), (0, 0, 1)], 4: [(0, 0, r) for r in range(4)]})):
        cp = ContextParallel.split(dist.group.WORLD, T_TOTAL, cu, attention="ring")
        plan = cp_attention.ring_plan(cp)
        got = (plan["recv"], plan["send"], plan["last"])
        if got != want[world][rank]:
            failures.append(f"plan {cu} rank {rank}/{world}: (recv, send, last) {got}, expected {want[world][rank]}")
    return failures


def _model():
    torch.manual_seed(0)
    cfg = GDNConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, layer_pattern="AGA", num_heads=2,
                    head_dim=8, num_v_heads=4, expand_v=1.0, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, conv_size=4, initializer_range=0.2)
    return GDNForCausalLM(cfg).double().train()


def _check_model(rank, world):
    """A stack with global attention layers (and a Gated DeltaNet between them): loss and every
    parameter's gradient, ring, equal one process (1e-6: the head's cross entropy runs in fp32)."""
    failures = []
    for lname, cu, B in LAYOUTS[:2]:
        ids = torch.randint(0, 64, (B, T_TOTAL), generator=torch.Generator().manual_seed(1))
        ref, model = _model(), _model()
        out = ref(input_ids=ids, labels=ids, cu_seqlens=None if cu is None else torch.tensor(cu))
        out.loss.backward()
        cp = ContextParallel.split(dist.group.WORLD, T_TOTAL, cu, attention="ring")
        got = model(input_ids=cp.shard(ids), labels=ids, context_parallel=cp)
        got.loss.backward()
        loss = got.loss.detach().clone()
        dist.all_reduce(loss)
        if not rel_err(loss, out.loss) < 1e-6:
            failures.append(f"model {lname} rank {rank}/{world}: loss {float(loss)} vs {float(out.loss)}")
        want = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            if not rel_err(g, want[name].grad) < 1e-6:
                failures.append(f"model {lname} rank {rank}/{world}: d{name} error {rel_err(g, want[name].grad):.2e}")
    return failures


def _check_memory(rank, world):
    """Bytes kept for the backward on the last rank: the ring keeps q, k, v, o and the log-sum-exp of
    its own slice, the same on every rank; the all-gather keeps every rank's keys and values."""
    B, HQ, HKV, D = 1, 4, 2, 16
    q, k, v, _ = _inputs(B, torch.float32, 0, HQ, HKV, D, D)
    got = {}
    for mode in ("ring", "gather"):
        cp = ContextParallel.split(dist.group.WORLD, T_TOTAL, attention=mode)
        mine = [_leaf(cp.shard(x)) for x in (q, k, v)]
        got[mode] = saved_bytes(lambda: cp_attention.softmax_attention(*mine, cp=cp))
    per_token = 4 * (2 * HQ * D + 2 * HKV * D + HQ)  # q, o, k, v, lse in fp32
    every = [None] * world
    dist.all_gather_object(every, got)
    failures = []
    T_r = T_TOTAL // world
    for r, g in enumerate(every):
        if g["ring"] != per_token * T_r:
            failures.append(f"ring rank {r}/{world} saves {g['ring']} bytes, expected {per_token * T_r}")
    kv_all = 4 * 2 * HKV * D * T_TOTAL  # the last rank reads every rank's keys and values
    if not every[-1]["gather"] >= kv_all:
        failures.append(f"gather: the last rank saves {every[-1]['gather']} bytes; every key and value is {kv_all}")
    return failures


def _worker(rank, world, score_budget):
    cp_attention.SCORE_BUDGET = score_budget  # small: each block in several query chunks
    mine = (_check_op(rank, world, torch.float64, 1e-10) + _check_op(rank, world, torch.float32, 1e-5)
            + _check_plan(rank, world) + _check_model(rank, world) + _check_memory(rank, world))
    failures = [None] * world
    dist.all_gather_object(failures, mine)
    failures = [f for per_rank in failures for f in per_rank]
    assert not failures, "\n".join(failures)


def test_two_processes():
    spawn(_worker_then_rejects, 2, 2 * 4 * 16 * 24)  # rows x heads x 16 queries x 24 keys: 3 chunks of a 48-token block


@pytest.mark.slow  # four processes on two cores: `make test-all`
def test_four_processes():
    spawn(_worker, 4, 2 * 4 * 16 * 24)  # 16-query chunks (the floor) of 24-token slices: 2 each


def _rejects(rank, world):
    with pytest.raises(ValueError, match="attention"):
        ContextParallel.split(dist.group.WORLD, 8, attention="all-to-all")


def _worker_then_rejects(rank, world, arg):
    """The two-process run, then the inputs it must refuse (one spawn for both: a spawn costs ~10 s
    of imports on two cores)."""
    _worker(rank, world, arg)
    _rejects(rank, world)
