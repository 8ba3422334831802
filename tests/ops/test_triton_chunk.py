"""Triton chunk kernels (gdn.ops.triton) on the CPU through Triton's interpreter (DESIGN §5 tier 3).

Every member, forward and backward (q, k, v, g, beta, initial state; through o and the final
state), against the float64 recurrence, at small awkward shapes: T ∈ {1, 63, 65}, K, V ∈ {16, 60},
HV = 2H, packed sequences with empty and one-token members. fp32 and fp16 (tl.dot on bf16 is
broken in the 3.6 interpreter: bf16 is checked on the GPU by tests/gpu).

TRITON_INTERPRET must be set before triton is first imported in the process; pytest-xdist
workers import each test module themselves, so setting it at the top of this module works
under ``-n 2`` as long as no earlier-collected module imported triton with it unset, in which
case the module is skipped rather than run on a GPU-less compiler.
"""
from __future__ import annotations

import copy
import weakref
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from gdn.ops.delta import reference  # noqa: E402
from gdn.ops import tuning  # noqa: E402
from gdn.ops.tuning import INTERPRET  # noqa: E402

from .helpers import HAS_BETA, HAS_G, MEMBERS, make_inputs, rel_err, spy_group_sum, warm_walks  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET was set in this process", allow_module_level=True)

from gdn.ops.delta.triton import chunk as chunk_mod  # noqa: E402
from gdn.ops.delta.triton.chunk import chunk_op  # noqa: E402
from gdn.ops.triton import common  # noqa: E402
from gdn.ops.triton import launch as L  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


@pytest.fixture(autouse=True, scope="module")
def _tuning_overrides():
    """``GDN_TUNING`` (inline JSON or a file, :func:`gdn.ops.tuning.update_from`) runs this module
    under launch overrides, e.g. ``'{"state_out": {"from_inverse": true}}'``; restored afterwards."""
    saved = copy.deepcopy(tuning.TABLES)
    if os.environ.get("GDN_TUNING"):
        tuning.update_from(os.environ["GDN_TUNING"])
    yield
    tuning.restore(saved)


def _record_launches(monkeypatch, *modules):
    """[(kernel name, launch settings)] of every kernel the launchers of ``modules`` start from
    now on (each still runs)."""
    seen = []

    def spy(launch):
        def run(kernel, grid, *args, **meta):
            seen.append((kernel.fn.__name__, meta))
            return launch(kernel, grid, *args, **meta)
        return run

    for mod in modules:
        monkeypatch.setattr(mod, "launch", spy(mod.launch))
    return seen


def _run_both(member, B, T, H, HV, K, V, dtype, lens=None, state=True, seed=0):
    N = len(lens) if lens else B
    d = make_inputs(B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=torch.float64, N=N, state=state, seed=seed)
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    names = ["q", "k", "v"] + (["g"] if HAS_G[member] else []) + (["beta"] if HAS_BETA[member] else [])
    if state:
        names.append("initial_state")
    gen = torch.Generator().manual_seed(seed + 7)
    ref_in = {n: d[n].detach().clone().requires_grad_(True) for n in names}
    o_r, S_r = reference.run(ref_in["q"], ref_in["k"], ref_in["v"], ref_in.get("g"), ref_in.get("beta"), None,
                              ref_in.get("initial_state"), True, cu)
    do = torch.randn(o_r.shape, generator=gen, dtype=torch.float64)
    dS = torch.randn(S_r.shape, generator=gen, dtype=torch.float64)
    ((o_r * do).sum() + (S_r * dS).sum()).backward()
    got_in = {n: d[n].detach().to(torch.float32 if n == "initial_state" else dtype).clone().requires_grad_(True)
              for n in names}
    o, S = chunk_op(got_in["q"], got_in["k"], got_in["v"], got_in.get("g"), got_in.get("beta"),
                    initial_state=got_in.get("initial_state"), output_final_state=True, cu_seqlens=cu)
    assert o.dtype == dtype and o.shape == o_r.shape
    assert S.dtype == torch.float32 and S.shape == S_r.shape
    ((o.double() * do).sum() + (S.double() * dS).sum()).backward()
    for n in names:  # every gradient comes back in its input's dtype
        assert got_in[n].grad.dtype == got_in[n].dtype, (n, got_in[n].grad.dtype)
    errs = {"o": rel_err(o, o_r), "S": rel_err(S, S_r)}
    errs.update({"d" + n: rel_err(got_in[n].grad, ref_in[n].grad) for n in names})
    return errs


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_member_T65_grouped(member, dtype):
    errs = _run_both(member, B=1, T=65, H=1, HV=2, K=16, V=60, dtype=dtype, seed=1)
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, bad


@pytest.mark.parametrize("member", MEMBERS)
def test_member_fp16_ungrouped(member):
    """HV = H in half precision: dq, dk, dv are written by the kernels in fp16 directly."""
    errs = _run_both(member, B=2, T=63, H=2, HV=2, K=60, V=16, dtype=torch.float16, seed=2)
    bad = {k: v for k, v in errs.items() if not v <= TOL[torch.float16]}
    assert not bad, bad


@pytest.mark.parametrize("T,K,V", [(1, 60, 16), (63, 16, 60)])
def test_gated_delta_rule_short(T, K, V):
    errs = _run_both("gated_delta_rule", B=2, T=T, H=1, HV=2, K=K, V=V, dtype=torch.float32, seed=T)
    bad = {k: v for k, v in errs.items() if not v <= TOL[torch.float32]}
    assert not bad, bad


@pytest.mark.parametrize("member", ["gated_delta_rule", "linear_attention"])
def test_packed(member):
    # lengths: a sequence over one chunk, a single token, an empty one, exactly one chunk
    errs = _run_both(member, B=1, T=130, H=1, HV=2, K=16, V=16, dtype=torch.float32, lens=[65, 1, 0, 64], seed=3)
    bad = {k: v for k, v in errs.items() if not v <= TOL[torch.float32]}
    assert not bad, bad


def test_no_state():
    o_ref, _ = _ref_no_state()
    d = make_inputs(B=1, T=63, H=1, HV=2, K=16, V=16, dtype=torch.float32, state=False, seed=5)
    o, S = chunk_op(d["q"], d["k"], d["v"], d["g"], d["beta"])
    assert S is None
    assert rel_err(o, o_ref) <= TOL[torch.float32]


def _ref_no_state():
    d = make_inputs(B=1, T=63, H=1, HV=2, K=16, V=16, dtype=torch.float64, state=False, seed=5)
    return reference.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"])


def test_triton_entry_points_run_every_member():
    """The family's Triton entry points take every member (g / beta None for what it lacks) and agree
    with each other on a short call (chunk kernels and token-recurrent kernel)."""
    from gdn.ops.delta import triton as T

    for op in MEMBERS:
        d = make_inputs(B=1, T=5, H=1, HV=2, K=16, V=16, dtype=torch.float32, seed=9)
        g = d["g"] if HAS_G[op] else None
        beta = d["beta"] if HAS_BETA[op] else None
        o1, s1 = T.run_chunk(d["q"], d["k"], d["v"], g, beta, initial_state=d["initial_state"], output_final_state=True)
        o2, s2 = T.run_recurrent(d["q"], d["k"], d["v"], g, beta, initial_state=d["initial_state"],
                                 output_final_state=True)
        assert rel_err(o1, o2) < 1e-4 and rel_err(s1, s2) < 1e-4, op
    assert "triton" not in sys.modules.get("gdn.ops").available_backends("cpu")


@pytest.mark.parametrize("keys", ["equal", "nearly equal"])
def test_degenerate_keys_stay_accurate(keys):
    """Every key (nearly) the same and β = 1: the worst case of the in-chunk inverse (its power
    series reaches entries of C(15, 7)); outputs and state still match the fp64 recurrence."""
    torch.manual_seed(0)
    B, T, H, K, V = 1, 130, 1, 32, 16
    base = torch.randn(1, 1, 1, K)
    k = base.expand(B, T, H, K) if keys == "equal" else base + 0.05 * torch.randn(B, T, H, K)
    k = torch.nn.functional.normalize(k, dim=-1).contiguous()
    q, v = torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    beta, g = torch.ones(B, T, H), torch.zeros(B, T, H)
    ro, rS = reference.gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                        output_final_state=True)
    for dt, tol in ((torch.float32, 1e-3), (torch.float16, 1e-2)):
        o, S = chunk_op(q.to(dt), k.to(dt), v.to(dt), g, beta, output_final_state=True)
        assert rel_err(o, ro) < tol and rel_err(S, rS) < tol, (dt, rel_err(o, ro), rel_err(S, rS))


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("L", [1, 2])
def test_split_state_pass(member, L, monkeypatch):
    """The split state passes (segments of L chunks: per-segment maps from [I | 0], the chain
    along each sequence, the rerun from the true states), forward and backward, on packed sequences
    with an empty, a one-token and a multi-chunk member and an initial state."""
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], L=L, warm=False))
    errs = _run_both(member, B=1, T=330, H=1, HV=2, K=16, V=32, dtype=torch.float32, lens=[65, 1, 0, 200, 64],
                     seed=11)
    bad = {k: v for k, v in errs.items() if not v <= TOL[torch.float32]}
    assert not bad, bad


@pytest.mark.parametrize("member,slice_mb,share,slices", [  # `make test`: two-chunk slices of the gated
    # delta rule, both forms; the other members' and one-chunk slices in `make test-all`
    pytest.param(m, mb, share, n, id=f"{sid}-{'shared' if share else 'plain'}-{m}",
                 marks=[] if (m, sid) == ("gated_delta_rule", "two-chunk-slices") else [pytest.mark.slow])
    for mb, sid, counts in ((0.04, "two-chunk-slices", (2, 2)), (1e-6, "one-chunk-slices", (4, 3)))
    for share, n in zip((False, True), counts) for m in MEMBERS])
def test_sliced_reverse_pass(member, slice_mb, share, slices, monkeypatch):
    """dh over the budget (DELTA["state_bwd"]["slice_MB"]): the reverse pass and the per-chunk kernels
    run slice by slice, dS carried between them, on packed sequences with an empty, a one-token and
    multi-chunk members, an initial state and a final-state gradient: the reference's gradients, and
    the unsliced backward's bit for bit. Plain: slices of chunk positions, dS_out in a buffer of one
    slice; ``share_h``: slices cut from each sequence's end, their dS_out written into h's own buffer
    (over the states of chunks already done, and a pad after each sequence), so that fewer slices
    keep the same peak (the longest sequence's 4 chunks: 1 + 2 + 1 instead of four slices of one)."""
    from gdn.ops.delta.triton import chunk_bwd

    args = dict(B=1, T=330, H=1, HV=2, K=16, V=32, dtype=torch.float32, lens=[65, 1, 0, 200, 64], seed=14)
    whole = _grads(member, **args)
    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], slice_MB=slice_mb, max_slices=8,
                                                       share_h=share))
    seen = _record_launches(monkeypatch, chunk_bwd)
    errs = _run_both(member, **args)
    bad = {k: v for k, v in errs.items() if not v <= TOL[torch.float32]}
    assert not bad, bad
    assert sum(name == "state_bwd_kernel" for name, _ in seen) == slices, seen
    sliced = _grads(member, **args)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced)), [(a - b).abs().max() for a, b in zip(whole, sliced)]


@pytest.mark.parametrize("L", [0, 4], ids=["sequences", "segments-of-4"])
def test_tail_slices_write_only_rows_already_done(L):
    """make_tail_slices and state_rows, over the sequences or over segments of L chunks: each run's
    chunks cut from its end; every chunk in one slice, its state row where the padded buffer holds
    it; a slice's dS_out rows lie in its run's region of that buffer, clear of every state the
    slices after it still read (their chunks come before it), and distinct."""
    dev = torch.device("cpu")
    ch = common.make_chunks(1, 1500, torch.tensor([0, 65, 66, 66, 1266, 1500]), dev)  # 2, 1, 0, 19, 4 chunks
    span = L or ch.max_nc
    sizes = common.tail_sizes(span, 3 if not L else 1)
    assert common.tail_sizes(19, 3) == [3, 6, 10] and common.tail_sizes(32, 11) == [11, 21]
    assert common.tail_sizes(5, 9) == [5] and common.tail_sizes(4, 1) == [1, 2, 1]
    sl = common.make_tail_slices(ch, sizes, dev, L)
    off, rows = common.state_rows(ch, sizes[0], dev, L, L)
    per = [2, 1, 0, 19, 4]
    # the runs: (sequence, first chunk, chunks)
    runs = [(n, c0, min(L, per[n] - c0) if L else per[n]) for n in range(5) for c0 in range(0, max(per[n], 1), L or 10 ** 9)
            if per[n] or not L]
    assert len(runs) == len(off) and rows == sum(k + min(sizes[0], k) for _, _, k in runs)
    if not L:
        assert off.tolist() == [0, 4, 6, 6, 28]
    else:  # pads between segments fit only a pass over those segments
        with pytest.raises(ValueError, match="straddle|not those"):
            common.state_rows(ch, sizes[0], dev, 0, L)
    run_of = {(n, c): i for i, (n, c0, k) in enumerate(runs) for c in range(c0, c0 + k)}
    state_row = {(n, c): off[run_of[n, c]].item() + c - runs[run_of[n, c]][1] for n, c in ch.chunk_idx.tolist()}
    every = sorted(tuple(c) for s in sl for c in s.chunk_idx.tolist())
    assert every == sorted(tuple(c) for c in ch.chunk_idx.tolist())
    for j, s in enumerate(sl):
        later = {state_row[n, c] for t in sl[j + 1:] for n, c in t.chunk_idx.tolist()}  # states still to be read
        assert s.rows[:, 0].tolist() == [state_row[n, c] for n, c in s.chunk_idx.tolist()]
        got = s.rows[:, 1].tolist()
        assert len(set(got)) == len(got)
        for (n, c), r in zip(s.chunk_idx.tolist(), got):
            i = run_of[n, c]
            k = runs[i][2]
            assert off[i].item() <= r < off[i].item() + k + min(sizes[0], k), (j, n, c, r)
            assert r not in later, (j, n, c, r)
            assert c - runs[i][1] >= k - sum(sizes[:j + 1])  # the run's last chunks first


def _grads(member, B, T, H, HV, K, V, dtype, lens, seed):
    """The chunk op's gradients of every input at one seeded draw (the final-state gradient given)."""
    d = make_inputs(B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, N=len(lens), state=True, seed=seed)
    names = ["q", "k", "v"] + (["g"] if HAS_G[member] else []) + (["beta"] if HAS_BETA[member] else [])
    x = {n: d[n].detach().clone().requires_grad_(True) for n in names + ["initial_state"]}
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    o, S = chunk_op(x["q"], x["k"], x["v"], x.get("g"), x.get("beta"), initial_state=x["initial_state"],
                    output_final_state=True, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(seed)
    ((o * torch.randn(o.shape, generator=gen)).sum() + (S * torch.randn(S.shape, generator=gen)).sum()).backward()
    return [x[n].grad for n in x]


def _warm(monkeypatch, L, log_eps=-16.0, fused=False):
    """Force the warm-started split state passes (segments of L chunks) in the two-stage forward's
    state pass, or with ``fused`` in the fused forward pass (value heads of 64 or more, as narrower
    ones always take the fused pass)."""
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], L=L, warm=True, log_eps=log_eps,
                                                    fused=fused))
    monkeypatch.setitem(tuning.DELTA, "state_out", dict(tuning.DELTA["state_out"], fill=10 ** 9))


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fused,L", [  # `make test` runs each form at one segment length
    pytest.param(f, n, id=f"{'fused' if f else 'two-stage'}-{n}", marks=[pytest.mark.slow] if (n == 2) != f else [])
    for f in (False, True) for n in (1, 2)])
def test_warm_split_state_pass(member, L, fused, monkeypatch):
    """The warm-started split (each segment walks back until the chunks' decay bounds the carried
    state below e^-16, or to its sequence's start) on packed sequences with an empty, a one-token
    and multi-chunk members and an initial state, forward (the two-stage or the fused pass) and
    backward: the reference's results. (Members without a gate take the chained split instead.)"""
    _warm(monkeypatch, L, fused=fused)
    errs = _run_both(member, B=1, T=458, H=1, HV=2, K=16, V=64, dtype=torch.float32, lens=[65, 1, 0, 328, 64],
                     seed=12)
    bad = {k: v for k, v in errs.items() if not v <= TOL[torch.float32]}
    assert not bad, bad


@pytest.mark.parametrize("slice_mb,share,slices", [(0.04, False, 2), (1e-6, True, 2), pytest.param(0.04, True, 2, marks=pytest.mark.slow),
                                                   pytest.param(1e-6, False, 3, marks=pytest.mark.slow)])
def test_warm_split_reverse_pass_sliced(slice_mb, share, slices, monkeypatch):
    """dh over the slicing budget with the warm-started split (segments of three chunks): the reverse
    pass runs slice by slice within the segments, counted from their ends (the first slice warms
    each segment up and carries the dS entering it out, the later ones go on from that), on packed
    sequences with an empty, a one-token, a one-segment and a two-segment member, an initial state
    and a final-state gradient: the unsliced backward's gradients bit for bit (those are the
    reference's: test_warm_split_state_pass). ``share_h``: the slices' dS_out in h's buffer, a pad
    after each segment (the recomputed state pass runs the same segments), so a budget of one chunk
    a segment takes slices of 1 + 2 chunks instead of three of one."""
    from gdn.ops.delta.triton import chunk_bwd

    args = dict(B=1, T=458, H=1, HV=2, K=16, V=32, dtype=torch.float32, lens=[65, 1, 0, 328, 64], seed=15)
    _warm(monkeypatch, 3)
    whole = _grads("gated_delta_rule", **args)
    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], slice_MB=slice_mb, max_slices=8,
                                                       share_h=share))
    seen = _record_launches(monkeypatch, chunk_bwd)
    sliced = _grads("gated_delta_rule", **args)
    assert sum(name == "state_bwd_kernel" for name, _ in seen) == slices, seen
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced)), [(a - b).abs().max() for a, b in zip(whole, sliced)]


def _decaying(T, g_value, key_scale=1.0, seed=13):
    """(max relative error of o and the final state, of the gradients of q, k, v and h0) of the chunk
    op against the reference, every token decaying by ``g_value``."""
    d = make_inputs(B=1, T=T, H=1, HV=1, K=16, V=64, dtype=torch.float64, seed=seed)
    d["g"] = torch.full_like(d["g"], g_value)
    d["k"] = d["k"] * key_scale
    names = ("q", "k", "v", "initial_state")
    ref = {n: d[n].clone().requires_grad_() for n in names}
    got = {n: d[n].float().requires_grad_() for n in names}
    ro, rS = reference.run(ref["q"], ref["k"], ref["v"], d["g"], d["beta"], None, ref["initial_state"], True, None)
    o, S = chunk_op(got["q"], got["k"], got["v"], d["g"].float(), d["beta"].float(), initial_state=got["initial_state"],
                    output_final_state=True)
    gen = torch.Generator().manual_seed(seed)
    do, dS = torch.randn(ro.shape, generator=gen, dtype=torch.float64), torch.randn(rS.shape, generator=gen,
                                                                                  dtype=torch.float64)
    ((ro * do).sum() + (rS * dS).sum()).backward()
    ((o.double() * do).sum() + (S.double() * dS).sum()).backward()
    return (max(rel_err(o, ro), rel_err(S, rS)), max(rel_err(got[n].grad, ref[n].grad) for n in names))


def test_warm_split_truncates_only_what_the_decay_bounds(monkeypatch):
    """One sequence of six chunks, segments of one chunk, every token decaying by 0.2 (12.8 per
    chunk): with the bound at e^-16 each segment warms up over two chunks and the results and
    gradients are the reference's; with no warm-up at all (the bound already met at the start) each
    segment starts from a zero state (dS in the reverse pass) and both are wrong, so the warm-up is
    what makes them right."""
    for fused in (False, True):
        _warm(monkeypatch, 1, fused=fused)
        ef, eb = _decaying(384, -0.2)
        assert ef <= TOL[torch.float32] and eb <= TOL[torch.float32], (fused, ef, eb)
        _warm(monkeypatch, 1, log_eps=1.0, fused=fused)
        ef, eb = _decaying(384, -0.2)
        assert ef > 1e-2 and eb > 1e-2, (fused, ef, eb)


def test_warm_split_counts_keys_that_expand_the_state(monkeypatch):
    """Keys of norm 2 (β‖k‖² up to 4: I − β k kᵀ stretches along k by up to 3) under a decay that
    alone would end the warm-up after one chunk: the bound adds log |1 − β‖k‖²| per token, the walk
    goes back to the sequence start and the results are the reference's."""
    for fused in (False, True):
        _warm(monkeypatch, 1, fused=fused)
        ef, eb = _decaying(256, -0.3, key_scale=2.0)
        assert ef <= 1e-4 and eb <= 1e-4, (fused, ef, eb)


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("fill", [0, 10 ** 9], ids=["fused", "two-stage"])
def test_forward_paths(member, fill, monkeypatch):
    """Both forwards: the fused pass (state and output in one sequential kernel) and the two-stage
    one (state pass storing h and δ, then the output kernel), forced by the fill rule of
    ``chunk._forward``, on packed sequences with an initial state: the same results."""
    monkeypatch.setitem(tuning.DELTA, "state_out", dict(tuning.DELTA["state_out"], fill=fill))
    errs = _run_both(member, B=1, T=194, H=1, HV=2, K=16, V=64, dtype=torch.float32, lens=[65, 1, 0, 128], seed=5)
    bad = {k: v for k, v in errs.items() if not v <= TOL[torch.float32]}
    assert not bad, bad


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fill", [0, 10 ** 9], ids=["fused", "two-stage"])
@pytest.mark.parametrize("from_inverse", [False, True], ids=["wu", "from-inverse"])
def test_forward_delta_from_inverse(member, dtype, fill, from_inverse, monkeypatch):
    """Both ways the forward's state pass forms δ: U − W S from wu's W and U, or T⁻¹ diag(β)(V −
    diag(Γ) K S) from the in-chunk inverse, v and β (``from_inverse``: no wu in the forward; the
    backward still recomputes δ from W and U), in the fused and the two-stage forward, packed, with
    an initial state, against the float64 recurrence. Members without the delta term ignore it."""
    monkeypatch.setitem(tuning.DELTA, "state_out", dict(tuning.DELTA["state_out"], fill=fill,
                                                        from_inverse=from_inverse))
    monkeypatch.setitem(tuning.DELTA, "state_fwd", dict(tuning.DELTA["state_fwd"], from_inverse=from_inverse))
    errs = _run_both(member, B=1, T=194, H=1, HV=2, K=60, V=64, dtype=dtype, lens=[65, 1, 0, 128], seed=13)
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, bad


@pytest.mark.parametrize("member", MEMBERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("K,V", [(32, 64), (128, 32)])
@pytest.mark.parametrize("tma", [True, False], ids=["descriptors", "pointers"])
def test_dqk_reads(member, dtype, K, V, tma, monkeypatch):
    """dqk reading δ (v), dO, dδ, h and dh through tensor descriptors (``DELTA["dqk"]["TMA"]``, taken
    on GPUs that have them) and through pointers (the form for the others): packed with an empty, a
    one-token and a partial sequence (a chunk's block reaches into the next sequence's rows, which
    must add nothing), grouped value heads, an initial state, one and two K tiles: the reference's
    gradients, and the launch takes the form asked for."""
    from gdn.ops.delta.triton import chunk_bwd

    monkeypatch.setitem(tuning.DELTA, "dqk", dict(tuning.DELTA["dqk"], TMA=tma))
    launches = _record_launches(monkeypatch, chunk_bwd)
    errs = _run_both(member, B=1, T=194, H=1, HV=2, K=K, V=V, dtype=dtype, lens=[65, 1, 0, 128], seed=18)
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, bad
    assert [meta["TMA"] for name, meta in launches if name == "dqk_kernel"] == [tma], launches


@pytest.mark.parametrize("member", ["gated_delta_rule", "delta_rule", "gated_linear_attention"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fill", [0, 10 ** 9], ids=["fused", "two-stage"])
def test_state_passes_with_tensor_descriptors(member, dtype, fill, monkeypatch):
    """The state passes reading their per-chunk inputs through tensor descriptors (``TMA`` of
    state_out, state_fwd and state_bwd; state_fwd also runs in the backward's recompute, from W and U):
    packed with an empty, a one-token and a partial sequence (a chunk's block reaches into the next
    sequence's rows, which must add nothing), grouped value heads, an initial state, against the
    float64 recurrence."""
    from gdn.ops.delta.triton import chunk_bwd, chunk_fwd

    monkeypatch.setitem(tuning.DELTA, "state_out", dict(tuning.DELTA["state_out"], fill=fill, TMA=True))
    monkeypatch.setitem(tuning.DELTA, "state_fwd", dict(tuning.DELTA["state_fwd"], TMA=True))
    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], TMA=True))
    launches = _record_launches(monkeypatch, chunk_fwd, chunk_bwd)
    errs = _run_both(member, B=1, T=194, H=1, HV=2, K=32, V=64, dtype=dtype, lens=[65, 1, 0, 128], seed=15)
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, bad
    seen = {}
    for name, meta in launches:
        if name in ("state_out_kernel", "state_fwd_kernel", "state_bwd_kernel"):
            seen.setdefault(name, []).append(meta["TMA"])
    # the fused pass takes descriptors for the delta members (its δ-from-inverse form) only
    assert seen["state_bwd_kernel"] == [True] and seen["state_fwd_kernel"][-1], seen
    if member != "gated_linear_attention":
        assert all(all(v) for v in seen.values()), seen


@pytest.mark.parametrize("member", ["gated_delta_rule", "delta_rule"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("form", ["plain", "descriptors", "warm split", "chained split"])
def test_backward_from_inverse(member, dtype, form, monkeypatch):
    """``DELTA["state_bwd"]["from_inverse"]``: the backward launches no wu; its recomputed state
    pass forms δ from T⁻¹ and its reverse pass Wᵀ dδ as Kᵀ diag(βΓ) (Tᵀ dδ). Every form of the
    reverse pass (per-thread loads, tensor descriptors, the warm-started split, the chained split's
    three phases), packed with an empty, a one-token and a partial sequence, grouped value heads
    and an initial state: the reference's gradients."""
    from gdn.ops.delta.triton import chunk_bwd

    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], from_inverse=True,
                                                        TMA=form == "descriptors"))
    split = {"warm split": dict(L=1, warm=True), "chained split": dict(L=1, warm=False)}.get(form, dict(L=0))
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], **split))
    from gdn.ops.delta.triton import chunk_fwd

    launches = _record_launches(monkeypatch, chunk_bwd, chunk_fwd)
    errs = _run_both(member, B=1, T=194, H=1, HV=2, K=32, V=64, dtype=dtype, lens=[65, 1, 0, 128], seed=16)
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, bad
    names = [(name, meta.get("FROM_INV")) for name, meta in launches]
    backward = names[names.index(("dv_local_kernel", None)) - 2:]  # from the recomputed state pass on
    assert ("wu_kernel", None) not in names, names
    assert [f for n, f in names if n == "state_bwd_kernel"] and all(f for n, f in names if n == "state_bwd_kernel"), names
    assert any(n == "state_fwd_kernel" and f for n, f in backward), backward


@pytest.mark.parametrize("member", ["gated_delta_rule", "delta_rule"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("split", [0, 1], ids=["plain", "warm split"])
def test_backward_from_stored_w_and_u(member, dtype, split, monkeypatch):
    """``DELTA["state_bwd"]["from_inverse"]`` off: the backward recomputes W and U (wu), its state
    pass forms δ = U − W S and its reverse pass reads W; packed with an empty, a one-token and a
    partial sequence, grouped value heads and an initial state: the reference's gradients."""
    from gdn.ops.delta.triton import chunk_bwd, chunk_fwd

    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], from_inverse=False))
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], L=split))
    launches = _record_launches(monkeypatch, chunk_bwd, chunk_fwd)
    errs = _run_both(member, B=1, T=194, H=1, HV=2, K=64, V=32, dtype=dtype, lens=[65, 1, 0, 128], seed=17)
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, bad
    names = [(name, meta.get("FROM_INV")) for name, meta in launches]
    assert ("wu_kernel", None) in names, names
    assert not any(f for n, f in names if n == "state_bwd_kernel"), names


@pytest.mark.parametrize("member", ["gated_delta_rule", "delta_rule"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tma", [False, True], ids=["loads", "descriptors"])
def test_fused_forward_reads_kkt_solves_pairs(member, dtype, tma, monkeypatch):
    """Delta members: kkt_solve also stores each chunk's Q Kᵀ ⊙ D (lower, diagonal kept, the
    decays exp(γ_i − γ_j)) and the fused pass reads it instead of forming it per value tile; packed
    with an empty, a one-token and a partial sequence, grouped value heads, an initial state,
    against the float64 recurrence, with plain loads and with tensor descriptors."""
    from gdn.ops.delta.triton import chunk_fwd

    monkeypatch.setitem(tuning.DELTA, "state_out", dict(tuning.DELTA["state_out"], fill=0, TMA=tma))
    launches = _record_launches(monkeypatch, chunk_fwd)
    errs = _run_both(member, B=1, T=194, H=1, HV=2, K=32, V=64, dtype=dtype, lens=[65, 1, 0, 128], seed=17)
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, bad
    seen = [("kkt_solve", meta["STORE_P"]) if name == "kkt_solve_kernel" else ("state_out", meta["PRE_P"], meta["TMA"])
            for name, meta in launches if name in ("kkt_solve_kernel", "state_out_kernel")]
    # the forward's kkt_solve stores the pairs and the fused pass reads them; the backward's
    # recompute (its own kkt_solve is not run: the forward's inverse is reused) is unchanged
    assert ("kkt_solve", True) in seen and ("state_out", True, tma) in seen, seen


def test_kkt_solve_pairs_are_the_gated_lower_qk():
    """kkt_solve's pair matrix against its definition, P_ij = (q_i·k_j) exp(γ_i − γ_j) for j ≤ i
    (0 above the diagonal and on rows past the sequence), at a partial chunk."""
    from gdn.ops.delta.triton import chunk_fwd

    T, H, HV, K = 100, 1, 2, 32
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(T, H, K, generator=gen), dim=-1)
    v = torch.randn(T, HV, 16, generator=gen)
    g = -torch.rand(T, HV, generator=gen)
    beta = torch.rand(T, HV, generator=gen)
    ch = common.make_chunks(1, T, None, q.device)
    P = torch.full((T, HV, 64), float("nan"))
    chunk_fwd.prepare(k, v, g, beta, ch, wu=False, q=q, pairs_out=P)
    for t0 in (0, 64):
        n = min(64, T - t0)
        gam = g[t0:t0 + n].cumsum(0)  # [n, HV]
        for hv in range(HV):
            qk = q[t0:t0 + n, hv // (HV // H)] @ k[t0:t0 + n, hv // (HV // H)].T
            want = torch.tril(qk * torch.exp(gam[:, None, hv] - gam[None, :, hv]).tril())
            got = P[t0:t0 + n, hv, :n]
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (t0, hv, (got - want).abs().max())
            assert torch.all(P[t0:t0 + n, hv, n:] == 0)


@pytest.mark.parametrize("member", ["gated_delta_rule", "delta_rule"])
def test_split_forward_from_inverse(member, monkeypatch):
    """The two-stage forward's split state pass (segments of one chunk: the augmented first phase
    forms δ from T⁻¹ too, its transition columns reading zero values) with ``from_inverse``."""
    monkeypatch.setitem(tuning.DELTA, "state_out", dict(tuning.DELTA["state_out"], fill=10 ** 9))
    monkeypatch.setitem(tuning.DELTA, "state_fwd", dict(tuning.DELTA["state_fwd"], from_inverse=True))
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], L=1, warm=False))
    errs = _run_both(member, B=1, T=194, H=1, HV=2, K=16, V=64, dtype=torch.float32, lens=[65, 1, 0, 128], seed=14)
    bad = {k: v for k, v in errs.items() if not v <= TOL[torch.float32]}
    assert not bad, bad


@pytest.mark.parametrize("fill", [0, 10 ** 9], ids=["fused", "two-stage"])
def test_from_inverse_forward_runs_no_wu(fill, monkeypatch):
    """With ``from_inverse`` the forward launches kkt_solve and the state pass but no wu kernel,
    and its state pass gets the inverse and β; so does the backward's recomputed state pass, and
    its reverse pass (``DELTA["state_bwd"]["from_inverse"]``, the default)."""
    from gdn.ops.delta.triton import chunk as chunk_mod
    from gdn.ops.delta.triton import chunk_bwd

    monkeypatch.setitem(tuning.DELTA, "state_out", dict(tuning.DELTA["state_out"], fill=fill, from_inverse=True))
    monkeypatch.setitem(tuning.DELTA, "state_fwd", dict(tuning.DELTA["state_fwd"], from_inverse=True))
    ch = common.make_chunks(1, 130, None, torch.device("cpu"))
    q, v = torch.randn(130, 1, 32), torch.randn(130, 2, 64)
    g, b = -torch.rand(130, 2), torch.rand(130, 2)
    with L.recording() as rec:
        _, _, ai, _ = chunk_mod._forward(q, q, v, g, b, None, ch, False, 0.25, torch.float32)
    names = [k.fn.__name__ for k, _, _, _ in rec]
    want = "state_out_kernel" if fill == 0 else "state_fwd_kernel"
    assert "kkt_solve_kernel" in names and want in names and "wu_kernel" not in names, names
    assert all(m["FROM_INV"] for k, _, _, m in rec if k.fn.__name__ == want)
    with L.recording() as rec:
        chunk_bwd.backward(q, q, v, g, b, None, v, None, ch, 0.25, ai)
    assert "wu_kernel" not in [k.fn.__name__ for k, _, _, _ in rec]
    passes = [m["FROM_INV"] for k, _, _, m in rec if k.fn.__name__ in ("state_fwd_kernel", "state_bwd_kernel")]
    assert len(passes) == 2 and all(passes), passes


@pytest.mark.parametrize("member", ["gated_delta_rule", "delta_rule", "gated_linear_attention"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_bwd_row_scale_on_q(member, dtype, monkeypatch):
    """state_bwd's second form (QS: the (ΓQ)ᵀ dO term's row scale on Q instead of dO; on the GPU
    the launch picks it by waves) gives the reference's gradients, packed, with an initial state,
    and also as the split pass's third phase."""
    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], stages=((2, {"QS": True}),)))
    errs = _run_both(member, B=1, T=194, H=1, HV=2, K=16, V=32, dtype=dtype, lens=[65, 1, 0, 128], seed=7)
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, bad
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], L=1, warm=False))
    errs = _run_both(member, B=1, T=194, H=1, HV=2, K=16, V=32, dtype=dtype, lens=[65, 1, 0, 128], seed=7)
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, bad


def test_split_fp16_batched(monkeypatch):
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], L=2, warm=False))
    errs = _run_both("gated_delta_rule", B=2, T=300, H=1, HV=2, K=32, V=16, dtype=torch.float16, seed=12)
    bad = {k: v for k, v in errs.items() if not v <= TOL[torch.float16]}
    assert not bad, bad


def test_segments_tile_the_stream():
    ch = common.make_chunks(1, 330, torch.tensor([0, 65, 66, 66, 266, 330]), torch.device("cpu"))
    sg = common.make_segments(ch, 2, torch.device("cpu"))
    # chunks per sequence 2, 1, 0, 4, 1 -> segments 1, 1, 0, 2, 1
    assert sg.count.tolist() == [1, 1, 0, 2, 1] and sg.first.tolist() == [0, 1, 2, 2, 4]
    assert sg.cu.tolist() == [0, 65, 66, 194, 266, 330] and sg.off.tolist() == [0, 2, 3, 5, 7]
    assert (sg.NS, sg.L, sg.max_ns) == (5, 2, 2)


def test_slices_cover_every_chunk_once():
    """make_slices: slices of L chunk positions, last first; each sequence's part as token bounds
    (empty parts start where they end), chunks numbered in the slice's own order from off[n]; every
    chunk of the call in exactly one slice."""
    ch = common.make_chunks(1, 330, torch.tensor([0, 65, 66, 66, 266, 330]), torch.device("cpu"))
    sl = common.make_slices(ch, 2, torch.device("cpu"))
    # chunks per sequence 2, 1, 0, 4, 1: slice 1 holds sequence 3's chunks 2 and 3 only
    assert [s.NT for s in sl] == [2, 6]
    assert sl[0].chunk_idx.tolist() == [[3, 2], [3, 3]] and sl[0].off.tolist() == [0, 0, 0, 0, 2]
    assert sl[0].starts.tolist() == [65, 66, 66, 194, 330] and sl[0].ends.tolist() == [65, 66, 66, 266, 330]
    assert sl[1].starts.tolist() == [0, 65, 66, 66, 266] and sl[1].ends.tolist() == [65, 66, 66, 194, 330]
    assert sl[1].off.tolist() == [0, 2, 3, 3, 5]
    every = sorted(tuple(c) for s in sl for c in s.chunk_idx.tolist())
    assert every == sorted(tuple(c) for c in ch.chunk_idx.tolist())
    # each chunk's state at its global index in h, its dS_out at its index in the slice's own buffer
    for s in sl:
        assert s.rows[:, 0].tolist() == [ch.chunk_off[n].item() + c for n, c in s.chunk_idx.tolist()]
        assert s.rows[:, 1].tolist() == list(range(s.NT))
    assert common.make_slices(ch, 2, torch.device("cpu")) is sl  # made once per layout


def test_split_len_rule(monkeypatch):
    from gdn.ops.delta.triton.split import split_len

    cpu = torch.device("cpu")
    ch = common.make_chunks(1, 64 * 512, None, cpu)
    base = dict(tuning.DELTA["split"], min_L=8, fill=2.0, per_sm=2)
    monkeypatch.setitem(tuning.DELTA, "split", dict(base, L=0))
    assert split_len(ch, 1, 1, cpu) == 0
    monkeypatch.setitem(tuning.DELTA, "split", dict(base, L=16))
    assert split_len(ch, 1, 1, cpu) == 16
    monkeypatch.setitem(tuning.DELTA, "split", dict(base, L=-1))  # auto: 4 "SMs" on the CPU
    assert split_len(ch, 1, 1, cpu) == 64  # 512 chunks in 8 parts: 8 programs, 2 per SM
    assert split_len(ch, 3, 1, cpu) == 256  # 3 programs: 2 parts of 256 chunks (6 programs, one wave)
    assert split_len(ch, 8, 1, cpu) == 0  # 8 programs already fill 2 x 4
    assert split_len(ch, 1, 1, cpu, warm=False) == 0  # auto never takes the chained split
    # a packed batch: its one long sequence's programs are what runs at the end; the short ones are cut too
    lens = [64 * 400, 64 * 20, 64 * 10]
    pk = common.make_chunks(1, sum(lens), torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]), cpu)
    assert pk.long_sequences == 1 and split_len(pk, 1, 1, cpu) == 50


def test_recording_collects_launches_without_running():
    """precompile's dry run: inside recording() the launchers allocate but launch nothing."""
    d = make_inputs(B=1, T=130, H=1, HV=2, K=16, V=16, dtype=torch.float32, state=True, seed=4)
    ch = common.make_chunks(1, 130, None, torch.device("cpu"))
    from gdn.ops.delta.triton import chunk_bwd, chunk_fwd

    qp, kp = d["q"].reshape(130, 1, 16), d["k"].reshape(130, 1, 16)
    vp, gp, bp = d["v"].reshape(130, 2, 16), d["g"].reshape(130, 2), d["beta"].reshape(130, 2)
    with L.recording() as rec:
        h, vn, _, _, _, _ = chunk_fwd.forward_intermediates(qp, kp, vp, gp, bp, d["initial_state"], ch, True)
        chunk_fwd.output(qp, kp, vp, gp, h, vn, ch, 0.25, torch.float32)
        chunk_fwd.forward(qp, kp, vp, gp, bp, d["initial_state"], ch, True, 0.25, torch.float32)
        chunk_bwd.backward(qp, kp, vp, gp, bp, d["initial_state"], vp, None, ch, 0.25)
    names = [k.fn.__name__ for k, _, _, _ in rec]
    for n in ("kkt_solve_kernel", "wu_kernel", "state_fwd_kernel", "output_kernel", "state_out_kernel", "dv_local_kernel",
              "state_bwd_kernel", "dqk_kernel", "wy_bwd_kernel"):
        assert n in names, n
    assert all("num_warps" in meta and "num_stages" in meta for _, _, _, meta in rec)
    assert L._RECORD is None  # recording ends with the context


def test_narrow_values_take_the_fused_forward(monkeypatch):
    """Value heads narrower than 64 never reach the output kernel (miscompiled for bf16 tiles of
    16-32 on the H200), whatever the fill rule says."""
    from gdn.ops.delta.triton import chunk as chunk_mod

    monkeypatch.setitem(tuning.DELTA, "state_out", dict(tuning.DELTA["state_out"], fill=10 ** 9))
    ch = common.make_chunks(1, 70, None, torch.device("cpu"))
    for V, want, other in ((32, "state_out_kernel", "output_kernel"), (64, "output_kernel", "state_out_kernel")):
        q = torch.randn(70, 1, 32)
        v = torch.randn(70, 2, V)
        g, b = -torch.rand(70, 2), torch.rand(70, 2)
        with L.recording() as rec:
            chunk_mod._forward(q, q, v, g, b, None, ch, False, 0.25, torch.float32)
        names = [k.fn.__name__ for k, _, _, _ in rec]
        assert want in names and other not in names, (V, names)


def test_output_kernel_keeps_value_tiles_of_64_for_half_inputs(monkeypatch):
    """A launch table asking the output kernel for value tiles of 32 gets them for fp32 inputs only:
    for bf16 and fp16 the tile stays 64 wide (narrower ones are miscompiled on the H200)."""
    from gdn.ops.delta.triton import chunk_fwd

    monkeypatch.setitem(tuning.DELTA, "output", dict(tuning.DELTA["output"], BV=32))
    ch = common.make_chunks(1, 70, None, torch.device("cpu"))
    for dtype, want in ((torch.float32, 32), (torch.bfloat16, 64), (torch.float16, 64)):
        q = torch.randn(70, 1, 32, dtype=dtype)
        v = torch.randn(70, 2, 128, dtype=dtype)
        h = torch.zeros(ch.NT, 2, 32, 128, dtype=dtype)
        with L.recording() as rec:
            chunk_fwd.output(q, q, v, -torch.rand(70, 2), h, v, ch, 0.25, dtype)
        (kernel, grid, _, meta), = rec
        assert kernel.fn.__name__ == "output_kernel" and meta["BV"] == want and grid[0] == 128 // want, (dtype, meta)


def test_fused_forward_never_takes_one_stage():
    """state_out has no one-stage candidate, although the fewest-waves rule would take it where one
    stage holds more programs per multiprocessor (K = V = 256, and fp32 at K = 128; tools/sass_cpu.py
    --depths): on the H200 triton 3.6 compiles it so that it reads out of bounds (an illegal memory
    access at (8, 2048, 16, 128) forced to one stage and at (8, 2048, 16, 256), bf16)."""
    depths = [n for n, _ in L.candidates(tuning.DELTA["state_out"]["stages"])]
    assert depths and min(depths) >= 2, depths


def test_fused_forward_only_at_value_tiles_of_bv_min():
    """At K = V = 256 the fused pass's value tile would be 16, below its BV_min: such a call takes the
    two-stage forward however many programs it has; at K = V = 128 the same call takes the fused
    pass."""
    from gdn.ops.delta.triton import chunk as chunk_mod

    ch = common.make_chunks(64, 2048, None, torch.device("cpu"))
    assert chunk_mod.layout(ch, 16, 128, 128, torch.device("cpu"))[0]
    fused, bv, _, _, _ = chunk_mod.layout(ch, 16, 256, 256, torch.device("cpu"))
    assert bv < tuning.DELTA["state_out"]["BV_min"] and not fused


def test_pipeline_depth_by_waves():
    """The sequential passes' launch rule: of the (depth, form) candidates, fewest waves of the
    grid, the first among equals; programs per multiprocessor from shared memory (1 KB reserved
    each), registers and threads."""
    sm90 = L.SM90
    # state_bwd at (4, 8192) compiled for sm_90 (tools/sass_cpu.py --depths): 3 stages 173 KB,
    # 2 stages 117 KB (QS: 112.5), 1 stage 44 KB and 214 registers, 4 warps
    compiled = [((3, {}), 173, 183), ((3, {"QS": True}), 169, 183), ((2, {}), 117, 184),
                ((2, {"QS": True}), 112.5, 184), ((1, {}), 44, 214)]
    fits = [(c, L.per_sm(int(kb * 1024), regs, 4, sm90)) for c, kb, regs in compiled]
    assert [n for _, n in fits] == [1, 1, 1, 2, 2]
    assert L.pick(fits, 256, 132) == (2, {"QS": True})  # one wave: two per multiprocessor
    assert L.pick(fits, 128, 132) == (3, {})  # one wave at every candidate: the first
    assert L.pick(fits, 1000, 132) == (2, {"QS": True})  # 4 waves against 8
    assert L.pick(fits[:3] + fits[4:], 256, 132) == (1, {})
    assert L.per_sm(0, 255, 4, sm90) == 2  # registers: 255 → 256 per thread, 32 K per program
    assert L.per_sm(0, 32, 32, sm90) == 2  # threads: 1024 per program
    # a waves launch records every candidate (the parallel precompile compiles each)
    saved = copy.deepcopy(tuning.DELTA)
    try:
        tuning.update({"state_fwd": {"stages": [3, [3, {"X": 1}], 2, [1, {"X": 1}]]}})
        assert L.candidates(tuning.DELTA["state_fwd"]["stages"]) == [(3, {}), (3, {"X": 1}), (2, {}),
                                                                             (1, {"X": 1})]
        interp, L.INTERPRET = L.INTERPRET, False
        try:
            with L.recording() as rec:
                L.launch(object(), (1,), name="state_fwd", BV=32)
        finally:
            L.INTERPRET = interp
        assert [(m["num_stages"], m.get("X")) for _, _, _, m in rec] == [(3, None), (3, 1), (2, None), (1, 1)]
    finally:
        tuning.DELTA.clear()
        tuning.DELTA.update(saved)


def test_launch_by_waves_picks_from_compiled_resources(monkeypatch):
    """A waves launch compiles each candidate (``warmup``), skips those that do not fit, and runs the
    one whose grid needs the fewest waves; the choice is remembered, and a new grid size re-decides
    without compiling again. Fake kernel: state_bwd's sm_90 resources at value tiles of 32."""
    import triton

    res = {(3, False): (173, 183), (3, True): (169, 212), (2, False): (117, 184), (2, True): (113, 212),
           (1, True): (32, 224)}
    compiled, launched = [], []

    class Compiled:
        def __init__(self, ns, qs):
            kb, self.n_regs = res[(ns, qs)]
            self.metadata = type("M", (), {"shared": kb * 1024})()
            self.ns = ns

        def _init_handles(self):
            if self.ns == 3:  # as if this card had too little shared memory for three stages
                raise triton.runtime.errors.OutOfResources(self.metadata.shared, 0, "shared memory")

    class Kernel:
        def warmup(self, *args, grid, num_stages, **meta):
            compiled.append((num_stages, meta.get("QS", False)))
            return Compiled(num_stages, meta.get("QS", False))

        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append((grid, meta["num_stages"], meta.get("QS", False)))

    monkeypatch.setattr(L, "INTERPRET", False)
    monkeypatch.setattr(L, "sm_count", lambda device: 132)
    k = Kernel()
    L.launch(k, (4, 64), name="state_bwd", BV=32)  # 256 programs
    assert len(compiled) == 5
    assert launched[-1] == ((4, 64), 2, True)  # two per multiprocessor: one wave
    L.launch(k, (4, 32), name="state_bwd", BV=32)  # 128 programs: one wave at every depth
    assert len(compiled) == 5 and launched[-1] == ((4, 32), 2, False)  # the first that fits
    L.launch(k, (8, 64), name="state_bwd", BV=32)  # 512: two waves at two per multiprocessor
    assert launched[-1] == ((8, 64), 2, True)
    # a tensor passed by keyword (state_bwd's β) is an argument: each call's new tensor neither
    # compiles the candidates again nor stays alive in the remembered choice
    L.launch(k, (4, 64), name="state_bwd", BV=32, beta=torch.zeros(3))
    n, b = len(compiled), torch.zeros(3)
    alive = weakref.ref(b)
    L.launch(k, (4, 64), name="state_bwd", BV=32, beta=b)
    assert len(compiled) == n and launched[-1] == ((4, 64), 2, True)
    del b
    assert alive() is None


def test_state_tile_and_long_sequences():
    """The forward passes' value tile halves while the programs would not fill the card (4 "SMs"
    off CUDA), down to the kernel's floor; a packed batch counts only its near-longest sequences."""
    from gdn.ops.delta.triton import chunk as chunk_mod
    from gdn.ops.delta.triton.chunk_fwd import state_tile

    cpu = torch.device("cpu")
    one = common.make_chunks(1, 640, None, cpu)
    assert state_tile("state_fwd", one, 1, 128, 128, cpu) == (128, 32)  # 64 → 32: 4 programs
    assert state_tile("state_fwd", one, 1, 128, 32, cpu) == (128, 16)  # 32 → 16: 2 programs, floor 16
    assert state_tile("state_out", one, 1, 128, 32, cpu) == (128, 32)  # floor 32
    assert state_tile("state_fwd", common.make_chunks(8, 64, None, cpu), 1, 128, 128, cpu) == (128, 64)
    # the layout (fused forward or not, the passes' tiles) keys the parallel first-call compile
    assert chunk_mod.layout(one, 1, 128, 128, cpu) == (False, 32, 32, 32, False)
    assert chunk_mod.layout(common.make_chunks(8, 64, None, cpu), 1, 128, 128, cpu) == (True, 32, 64, 64, False)
    assert common.make_chunks(3, 200, None, cpu).long_sequences == 3
    packed = common.make_chunks(1, 700, torch.tensor([0, 640, 641, 641, 700]), cpu)
    assert packed.long_sequences == 1


@pytest.mark.parametrize("member", ["gated_delta_rule", "gated_linear_attention"])
@pytest.mark.parametrize("fill", [0, 10 ** 9], ids=["fused", "two-stage"])
def test_gamma_made_once_per_forward_and_backward(member, fill, monkeypatch):
    """γ (the in-chunk cumulative decay) is made once per forward + backward and handed from the
    forward to the backward: by the inverse's kernel for the gated delta rule (no cumsum launch at
    all), by one cumsum launch for the members without the delta term. The inverse kernel's γ equals
    the cumsum kernel's, and a backward that recomputes γ gives the same gradients."""
    from gdn.ops.delta.triton import chunk_bwd, chunk_fwd

    monkeypatch.setitem(tuning.DELTA, "state_out", dict(tuning.DELTA["state_out"], fill=fill))
    calls = []
    real = chunk_fwd.chunk_cumsum
    monkeypatch.setattr(chunk_fwd, "chunk_cumsum", lambda g, ch: calls.append(1) or real(g, ch))
    d = make_inputs(B=1, T=100, H=1, HV=2, K=16, V=16, dtype=torch.float32, state=True, seed=5)
    names = ("q", "k", "v", "g", "beta") if member == "gated_delta_rule" else ("q", "k", "v", "g")
    xs = {n: d[n].clone().requires_grad_(True) for n in names}
    o, _ = chunk_op(xs["q"], xs["k"], xs["v"], xs["g"], xs.get("beta"), initial_state=d["initial_state"])
    o.sum().backward()
    assert len(calls) == (0 if member == "gated_delta_rule" else 1)
    ch = common.make_chunks(1, 100, None, torch.device("cpu"))
    qp, kp = d["q"].reshape(100, 1, 16), d["k"].reshape(100, 1, 16)
    vp, gp = d["v"].reshape(100, 2, 16), d["g"].reshape(100, 2)
    bp = d["beta"].reshape(100, 2) if member == "gated_delta_rule" else None
    if bp is not None:
        G = torch.empty_like(gp)
        chunk_fwd.prepare(kp, vp, gp, bp, ch, wu=False, gamma_out=G)
        assert torch.allclose(G, real(gp, ch), atol=1e-6)
    # the backward on its own (no Ai, no γ given) recomputes both and gives the same gradients
    dq = chunk_bwd.backward(qp, kp, vp, gp, bp, d["initial_state"], torch.ones_like(vp), None, ch, 16 ** -0.5)[0]
    assert torch.allclose(dq.sum(1).reshape(1, 100, 1, 16), xs["q"].grad, atol=1e-5)


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the tensors allocated inside the mode (torch.empty / empty_like) still alive, and
    their peak: what a backward holds at once on top of its inputs."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, n):
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default):
            n = out.untyped_storage().nbytes()
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(out, self._free, n)
        return out


def test_backward_peak_holds_only_what_the_next_kernel_reads(monkeypatch):
    """The backward drops W after the reverse state pass, δ after dqk, and allocates wy_bwd's dK
    output after dqk: its peak is h and dh (two [chunks, HV, K, V] tensors each as large as two
    [T, HV, K] ones) plus δ, dδ, dQ, dK (fp32) and dW: ten [T, HV, 128] half tensors, against
    twelve when everything lived to the end."""
    from gdn.ops.delta.triton import chunk_bwd, chunk_fwd

    for mod in (chunk_bwd, chunk_fwd):  # launches as no-ops that keep no reference to their tensors
        monkeypatch.setattr(mod, "launch", lambda *a, **k: None)
    T, HV, K = 512, 2, 128
    ch = common.make_chunks(1, T, None, torch.device("cpu"))
    q = torch.randn(T, 1, K).half()
    v = torch.randn(T, HV, K).half()
    g, b = -torch.rand(T, HV), torch.rand(T, HV)
    ai = torch.zeros(T, HV, 64).half()
    unit = T * HV * K * 2
    with _LiveBytes() as mem:
        chunk_bwd.backward(q, q, v, g, b, None, v, None, ch, 0.25, ai, torch.float16, g.clone())
    assert 10 * unit <= mem.peak < 10.5 * unit, mem.peak / unit


# (not bf16: the interpreter truncates fp32 to bf16 where the GPU rounds; tests/gpu covers it)
@pytest.mark.parametrize("G,D,width,dtype", [(4, 128, 128, torch.float16), (2, 64, 60, torch.float32),
                                             (3, 32, 17, torch.float16)])
def test_group_sum_is_the_fp32_sum_rounded_once(G, D, width, dtype):
    """common.group_sum: x[..., G, D] summed over G in fp32, cut to ``width`` columns, rounded once
    to ``dtype`` (the grouped heads' dq and dk)."""
    x = torch.randn(2, 37, 3, G, D)
    y = common.group_sum(x, width, dtype)
    want = x[..., :width].double().sum(-2)
    assert y.shape == (2, 37, 3, width) and y.dtype == dtype
    # rounded once: within half a unit in the last place of ``dtype`` (plus the fp32 sum's error)
    half_ulp = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -23}[dtype]
    assert ((y.double() - want).abs() <= want.abs() * (half_ulp + 2e-7) + 1e-6).all()


def test_launch_settings_name_what_they_do_not_know():
    """A misspelt kernel or setting in a launch-settings override (a benchmark's --config, GDN_TUNING)
    raises one line naming it, and nothing of the override is applied; known ones apply."""
    saved = copy.deepcopy(tuning.DELTA)
    try:
        with pytest.raises(ValueError, match="'split' has no setting 'wram'"):
            tuning.update({"dqk": {"num_warps": 8}, "split": {"wram": True}})
        assert tuning.DELTA["dqk"]["num_warps"] == saved["dqk"]["num_warps"]  # nothing applied
        with pytest.raises(ValueError, match="no kernel 'dqkk'"):
            tuning.update({"dqkk": {"num_warps": 8}})
        with pytest.raises(ValueError, match="no kernel 'kda.nope'"):
            tuning.update({"kda.nope": {"BK": 32}})
        tuning.update_from('{"split": {"L": -1, "warm": true}, "state_fwd": {"waves": false}}')
        assert tuning.DELTA["split"]["warm"] is True and tuning.DELTA["split"]["L"] == -1
    finally:
        tuning.DELTA.clear()
        tuning.DELTA.update(saved)


@pytest.mark.parametrize("source", ("kkt_solve", "bound_kernel", "gate"))
@pytest.mark.parametrize("after", (False, True), ids=("before", "after"))
def test_warm_plan_counts_the_walk_of_each_segment(after, source):
    """split.warm_plan (the warm-up chunks of each segment and value head, which the warp-specialised
    passes read before they start) walks back (the forward's; ``after``: forward from the segment's
    end, the reverse pass's) as the passes' own warm-up does: packed sequences (one empty, one of a
    single token) in segments of one chunk, each head its own decay and keys of mixed norms, against
    the walk written out in torch from the raw gate (a chunk's bound: the sum of its g, plus
    log max(1, |1 − β‖k‖²|) of each row; the sum of its g alone without the delta term). The
    chunks' bounds come from kkt_solve (the forward's), from split.bound_kernel (a backward handed
    no bounds), or, without the delta term, from γ itself."""
    from gdn.ops.delta.triton import chunk_fwd, split
    from gdn.ops.triton.common import chunk_cumsum, make_chunks, make_segments

    lens, H, HV, K, BT = [65, 1, 0, 1300, 200, 130], 1, 2, 16, 64
    T = sum(lens)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(T, H, K, generator=gen) * torch.rand(T, H, 1, generator=gen) * 0.5
    beta = torch.rand(T, HV, generator=gen)
    g = -torch.rand(T, HV, generator=gen) * torch.tensor([0.4, 0.005])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    ch = make_chunks(1, T, cu, k.device)
    sg = make_segments(ch, 1, k.device)
    G = chunk_cumsum(g, ch)
    if source == "kkt_solve":
        bnd, G2 = torch.full((ch.NT, HV), float("nan")), torch.empty_like(g)
        chunk_fwd.prepare(k, torch.zeros(T, HV, 16), g, beta, ch, wu=False, gamma_out=G2, bound_out=bnd)
        assert torch.allclose(G2, G, atol=1e-5)
    elif source == "bound_kernel":
        plans = {}
        bnd = split.bounds(k, beta, G, ch, HV, plans)
        assert plans["bound"] is bnd and split.bounds(k, beta, G, ch, HV, plans) is bnd  # made once
    else:
        bnd = split.bounds(k, None, G, ch, HV)
        assert bnd is None
    nw = split.warm_plan(bnd, G, sg, ch, HV, after=after)
    walks = warm_walks(k, beta, g, cu, sg.cu.tolist(), sg.seq.tolist(), HV, after, delta=source != "gate")
    for (s, hv), (expect, _) in walks.items():
        assert int(nw[s, hv]) == expect, (s, hv, int(nw[s, hv]), expect)
    assert int(nw.max()) > 16  # some walks take more than one block of bounds (warm_up's NB)


def test_grouped_heads_sum_partials_in_the_input_dtype(monkeypatch):
    """Half-precision grouped heads: the backward's per-value-head dq and dk come in the inputs'
    dtype (half the memory and traffic of fp32 partials) and each group is summed in fp32 by
    common.group_sum, within the fp16 tolerance of the reference."""
    seen = spy_group_sum(monkeypatch, chunk_mod)
    errs = _run_both("gated_delta_rule", B=1, T=65, H=1, HV=4, K=16, V=32, dtype=torch.float16, seed=5)
    assert seen == [(torch.float16, 4), (torch.float16, 4)], seen
    bad = {k: v for k, v in errs.items() if not v <= TOL[torch.float16]}
    assert not bad, bad


@pytest.mark.parametrize("lens", [[0], [0, 0, 0]])
def test_packed_call_of_empty_sequences_only(lens):
    """No token at all: the final state is the initial one, whose gradient is the final state's."""
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k = (torch.randn(1, 0, 1, 16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 0, 2, 32, requires_grad=True)
    g, beta = torch.randn(1, 0, 2).neg().requires_grad_(), torch.rand(1, 0, 2).requires_grad_()
    h0 = torch.randn(len(lens), 2, 16, 32, requires_grad=True)
    o, S = chunk_op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    dS = torch.randn_like(S)
    (S * dS).sum().backward()
    assert o.shape == (1, 0, 2, 32) and torch.equal(S, h0.detach()) and torch.equal(h0.grad, dS)


def test_per_shape_decisions_are_kept_until_the_tables_change(monkeypatch):
    """The forward's and the backward's decisions (fused pass or not, value tiles, the reverse
    pass, slices) are worked out once per chunk layout and shape and kept in the layout's memo: a
    second call takes them from there, and a launch table changed by ``tuning.update``, by an entry
    replaced whole or by ``tuning.restore`` makes a call decide again."""
    made = []  # layout() calls: one per decision
    real = chunk_mod.layout

    def counted(*a, **k):
        made.append(1)
        return real(*a, **k)

    monkeypatch.setattr(chunk_mod, "layout", counted)
    d = make_inputs(B=2, T=70, H=1, HV=1, K=16, V=16, dtype=torch.float32, N=2, state=False, seed=3)

    def call():
        o, _ = chunk_op(d["q"], d["k"], d["v"], d["g"], d["beta"])
        return o

    first = call()
    call()
    assert len(made) == 1
    saved = copy.deepcopy(tuning.TABLES)
    token = tuning.token()
    try:
        tuning.update({"state_out": {"fill": 10 ** 9}})
        assert tuning.token() != token
        assert torch.equal(call(), first) and len(made) == 2
        tuning.DELTA["state_out"] = dict(tuning.DELTA["state_out"], fill=0)  # an entry replaced whole
        call()
        assert len(made) == 3
    finally:
        tuning.restore(saved)
    call()
    call()
    assert len(made) == 4
    assert tuning.token() == tuning.token()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp32_inputs_take_their_launch_overrides(dtype):
    """An entry's ``fp32`` dict (tuning.for_dtype) is what fp32 inputs launch with, tiles, warps and
    pipeline depth, and half inputs keep the entry itself: kkt_solve, dqk and wy_bwd of one forward +
    backward, recorded on the CPU (nothing runs)."""
    from gdn.ops.delta.triton import chunk_bwd
    from gdn.ops.triton.common import make_chunks

    T, H, K, V = 128, 2, 128, 128
    q = torch.empty(T, H, K, dtype=dtype)
    k, v = torch.empty_like(q), torch.empty(T, H, V, dtype=dtype)
    g, beta = torch.zeros(T, H), torch.zeros(T, H)
    ch = make_chunks(1, T, None, torch.device("cpu"))
    with L.recording() as launches:
        _, _, ai, gam = chunk_mod._forward(q, k, v, g, beta, None, ch, False, K ** -0.5, dtype)
        chunk_bwd.backward(q, k, v, g, beta, None, v, None, ch, K ** -0.5, ai, dtype, gam)
    got = {kern.fn.__name__[:-7]: meta for kern, _, _, meta in launches}
    for name in ("kkt_solve", "dqk", "wy_bwd"):
        want = tuning.for_dtype(tuning.DELTA[name], dtype)
        m = got[name]
        assert m["num_warps"] == want["num_warps"] and m["num_stages"] == L.candidates(want["stages"])[0][0]
        assert m["BK"] == min(want["BK"], K), (name, m)
        if name != "kkt_solve":
            assert m["BV"] == min(want["BV"], V), (name, m)
    over = dtype == torch.float32
    assert (got["kkt_solve"]["BK"] == 16) == over and (got["wy_bwd"]["num_warps"] == 8) == over, got


@pytest.mark.parametrize("fused", [False, True], ids=["two-stage", "fused"])
def test_warm_split_bounds_come_from_kkt_solve(fused, monkeypatch):
    """Through autograd, every warm-up walk of a forward + backward (the forward's pass, the
    backward's recomputed state pass and its reverse pass, each in segments of one chunk) reads
    the chunk bounds the forward's kkt_solve stored: no kernel reads the keys for them again, and
    the gradients are the reference's (test_warm_split_state_pass)."""
    from gdn.ops.delta.triton import chunk_bwd, chunk_fwd, split

    _warm(monkeypatch, 1, fused=fused)
    seen = _record_launches(monkeypatch, chunk_fwd, chunk_bwd, split)
    _grads("gated_delta_rule", B=1, T=200, H=1, HV=2, K=16, V=64, dtype=torch.float32, lens=[65, 1, 0, 134], seed=4)
    names = [n for n, _ in seen]
    warm = [m for n, m in seen if n in ("state_out_kernel", "state_fwd_kernel", "state_bwd_kernel") and m.get("WARM")]
    assert "bound_kernel" not in names and any(m.get("STORE_B") for n, m in seen if n == "kkt_solve_kernel"), names
    assert len(warm) >= 3, names  # the forward's pass, the recomputed one and the reverse one
