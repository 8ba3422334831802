"""The Triton chunk kernels of the scalar-gate family on the GPU, every member, and the fused Gated
DeltaNet entry (prologue kernels + chunk kernels), against float64 references (tier 3, see
:mod:`tests.gpu.helpers`).

Per case the output, the final state and every gradient (q, k, v, g, β, initial state; reaching
them through o and through the final state) of ``gdn.ops.<member>(..., backend="triton")`` are
compared with the float64 PyTorch chunk form run on the fp32 inputs as drawn. fp32 runs take
the inputs in fp32; bf16 (and, at the awkward shapes, fp16) runs round q, k, v, g and β to that
dtype (the initial state stays fp32), and their bound is twice the PyTorch chunk form's error from
the same rounded inputs.

Cases: awkward shapes (T = 1, 63, 65; K, V not powers of two or narrower than the 32-wide tiles;
K = V = 256; packed sequences with an empty and a one-token member) and the benchmark shapes of
``benchmarks/ops_gpu.py`` (up to 32768 tokens, grouped value heads, 12 packed sequences). The
default set takes Gated DeltaNet at every shape and the other members at one awkward and one
benchmark shape (and K = V = 256 at a benchmark size); ``-m slow`` adds every member at every
awkward shape.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from gdn import ops
from gdn.ops.delta import chunk as chunk_form
from tests.ops.helpers import warm_walks

from .helpers import (DEVICE, FP32_TOL, HAS_BETA, HAS_G, assert_within, dtype_id, leaves, offsets,
                      outputs_and_grads, rel_err, tier3_bounds)

#: Members in the order _cases() numbers the cases by (a case's seed is its position); the first is
#: checked at every shape.
ORDER = ("gated_delta_rule", "delta_rule", "gated_linear_attention", "linear_attention")
DTYPES = (torch.float32, torch.bfloat16)

#: (name, B, T, H, HV, K, V, packed lengths or None, initial state?); tuples, as the reference cache keys them
#: T = 1 takes 16 sequences: dg and dβ then hold 64 entries each, enough for a relative error that
#: is not one draw's noise (with 8 entries the bf16 ratio to its bound ranged 0.5–1.9 over seeds).
AWKWARD = [
    ("T=1", 16, 1, 2, 4, 16, 60, None, True),
    ("T=63", 2, 63, 2, 4, 60, 16, None, True),
    ("T=65", 1, 65, 2, 4, 64, 100, None, True),
    ("T=300 K=V=128", 2, 300, 2, 2, 128, 128, None, True),
    ("T=300 K=100 V=64", 1, 300, 1, 2, 100, 64, None, False),
    ("K=V=256", 1, 200, 1, 1, 256, 256, None, True),
    ("packed", 1, 360, 2, 4, 64, 64, (65, 1, 0, 63, 128, 103), True),
]
BENCH = [
    ("(8,2048,16,128)", 8, 2048, 16, 16, 128, 128, None, False),
    ("(4,8192,16,128)", 4, 8192, 16, 16, 128, 128, None, False),
    ("(1,32768,16,128)", 1, 32768, 16, 16, 128, 128, None, False),
    ("(1,8192,16,HV=32,128)", 1, 8192, 16, 32, 128, 128, None, True),
    # K = V = 256 with many programs: the two-stage forward (the fused pass's value tiles would be
    # 16 here, below its BV_min; at one stage and those tiles it faulted on the H200)
    ("(8,2048,16,256)", 8, 2048, 16, 16, 256, 256, None, False),
    ("packed 12 seqs / 32768", 1, 32768, 16, 16, 128, 128,
     (4096, 1000, 7000, 300, 2048, 5000, 64, 3000, 1500, 4260, 2500, 2000), True),
]


def _cases():
    """(case, member, seed) params: the default set, then every other member at every awkward
    shape marked slow. Seeds are the case's position in its list."""
    default = ([(c, ORDER[0]) for c in AWKWARD] + [(AWKWARD[3], m) for m in ORDER[1:]]
               + [(c, ORDER[0]) for c in BENCH] + [(BENCH[0], m) for m in ORDER[1:]])
    params = [pytest.param(c, m, i, id=f"{c[0]}-{m}") for i, (c, m) in enumerate(default)]
    full = [(c, m) for c in AWKWARD for m in ORDER]
    params += [pytest.param(c, m, i, id=f"{c[0]}-{m}", marks=pytest.mark.slow)
               for i, (c, m) in enumerate(full) if (c, m) not in default]
    return params


def _args(member, xs):
    return [xs["q"], xs["k"], xs["v"]] + [xs[n] for n in ("g", "beta") if xs[n] is not None]


def _call(fn, member, cu):
    def call(xs):
        return fn(*_args(member, xs), initial_state=xs["initial_state"], output_final_state=True, cu_seqlens=cu)
    return call


def draw(member, B, T, H, HV, K, V, lens, state, seed, device=DEVICE):
    """fp64 copies of fp32 draws (unit-norm keys, g = logsigmoid(x + 3), β = sigmoid(x), the state
    × 0.3), packed offsets on the CPU or None, and the cotangents of o and of the final state."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device)

    N = len(lens) if lens else B
    d = {"q": r(B, T, H, K), "k": F.normalize(r(B, T, H, K), dim=-1), "v": r(B, T, HV, V),
         "g": F.logsigmoid(r(B, T, HV) + 3.0) if HAS_G[member] else None,
         "beta": torch.sigmoid(r(B, T, HV)) if HAS_BETA[member] else None,
         "initial_state": r(N, HV, K, V) * 0.3 if state else None}
    d = {n: None if x is None else x.double() for n, x in d.items()}
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    do = torch.randn(B, T, HV, V, generator=gen, device=device, dtype=torch.float64)
    dS = torch.randn(N, HV, K, V, generator=gen, device=device, dtype=torch.float64)
    return d, (offsets(lens) if lens else None), do, dS


@functools.lru_cache(maxsize=1)
def reference(case, member, seed, device=DEVICE):
    """Inputs and the float64 chunk-form results of one case, kept for the case's next dtype (the
    tests run the dtypes of a case one after the other and clear this after the last)."""
    _, B, T, H, HV, K, V, lens, state = case
    d, cu, do, dS = draw(member, B, T, H, HV, K, V, lens, state, seed, device)
    ref = outputs_and_grads(_call(getattr(chunk_form, member), member, cu), leaves(d, torch.float64), do, dS)
    return d, cu, do, dS, ref


def triton_op(member):
    """The op under test: the public op on the Triton backend (with gradients: the chunk kernels)."""
    return functools.partial(getattr(ops, member), backend="triton")


def check_case(case, member, seed, dtype, *, device=DEVICE, op=triton_op):
    """Errors of ``op(member)`` at one case and dtype against the float64 reference, and their bounds."""
    d, cu, do, dS, ref = reference(case, member, seed, device)
    wide = ("initial_state",)  # g and β take the run's dtype, as the model's projections give them
    got = outputs_and_grads(_call(op(member), member, cu), leaves(d, dtype, wide), do, dS)
    errs = {k: rel_err(got[k], ref[k]) for k in ref}
    base = None
    if dtype not in (torch.float32, torch.float64):
        chunk = outputs_and_grads(_call(getattr(chunk_form, member), member, cu), leaves(d, dtype, wide), do, dS)
        base = {k: rel_err(chunk[k], ref[k]) for k in ref}
    return errs, tier3_bounds(dtype, ref, base)


def check_once(case, member, seed, dtype, **kw):
    """:func:`check_case`, then the case's cached reference freed (a case run in one dtype only)."""
    try:
        return check_case(case, member, seed, dtype, **kw)
    finally:
        reference.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case,member,seed", _cases())
def test_chunk_kernels(case, member, seed, dtype):
    try:
        errs, bounds = check_case(case, member, seed, dtype)
    finally:
        if dtype == DTYPES[-1]:  # the case's last run: free its cached reference
            reference.cache_clear()
    assert_within(errs, bounds, f"{member} at {case[0]}, {dtype_id(dtype)}")


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in AWKWARD])
def test_chunk_kernels_fp16(case):
    """fp16 inputs (in the op's contract; the dot operands and intermediates are fp16 then, with
    a third of bf16's exponent range) at the awkward shapes, gated delta rule."""
    member, seed = ORDER[0], 1000 + AWKWARD.index(case)
    errs, bounds = check_once(case, member, seed, torch.float16)
    assert_within(errs, bounds, f"{member} at {case[0]}, float16")


#: cases for the warm-started split (value heads of 64 or more: narrower ones always take the fused
#: pass); the last one walks 128 chunks in segments of 2
WARM_CASES = [AWKWARD[3], AWKWARD[6], ("(1,8192,4,128)", 1, 8192, 4, 4, 128, 128, None, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in WARM_CASES])
@pytest.mark.parametrize("fused", [False, True], ids=["two-stage", "fused"])
def test_warm_split(case, dtype, fused, monkeypatch):
    """The warm-started split state passes (``DELTA["split"]["warm"]``) forced with segments of two
    chunks, in the two-stage forward's state pass or the fused forward pass, gated delta rule: tier
    3 against the float64 reference (g = logsigmoid(x + 3): about 3 nats of decay per chunk, so
    segments warm up over several chunks or walk back to their sequence's start). The Triton
    passes' forms: the warp-specialised forward is off here (its own warm form is
    test_fused_fwd.py's)."""
    from gdn.ops import tuning

    monkeypatch.setitem(tuning.DELTA, "fused_fwd", dict(tuning.DELTA["fused_fwd"], on=False))
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], L=2, warm=True, fused=fused))
    monkeypatch.setitem(tuning.DELTA, "state_out", dict(tuning.DELTA["state_out"], fill=10 ** 9))
    member, seed = ORDER[0], 2000 + WARM_CASES.index(case)
    try:
        errs, bounds = check_case(case, member, seed, dtype)
    finally:
        if dtype == DTYPES[-1]:
            reference.cache_clear()
    assert_within(errs, bounds, f"warm split, {member} at {case[0]}, {dtype_id(dtype)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_warm_plan_counts(after, dtype):
    """The warm-up counts of split.warm_plan on the GPU (the chunks' bounds stored by kkt_solve from
    its Gram blocks, read 16 at a time by the walk), packed sequences in segments of one chunk with
    heads that decay fast and slowly (walks of one chunk up to the sequence's start, some over more
    than one block of 16), against the walk written out in float64 from the same (rounded) inputs.
    A count may differ from it only where the float64 running sum at that chunk is within 1e-3 of
    the bound (rounding in the sums)."""
    from gdn.ops.delta.triton import chunk_fwd, split
    from gdn.ops.triton.common import make_chunks, make_segments

    lens, H, HV, K = [65, 1, 0, 1300, 200, 130, 2200], 2, 4, 128
    T = sum(lens)
    gen = torch.Generator().manual_seed(11)
    k = (torch.randn(T, H, K, generator=gen) * torch.rand(T, H, 1, generator=gen) * 0.2).to(dtype)
    beta = torch.rand(T, HV, generator=gen) * 2
    g = -torch.rand(T, HV, generator=gen) * torch.tensor([0.4, 0.05, 0.01, 0.004])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    ch = make_chunks(1, T, cu.to(DEVICE), torch.device(DEVICE))
    sg = make_segments(ch, 1, torch.device(DEVICE))
    G = torch.empty(T, HV, device=DEVICE)
    bnd = torch.full((ch.NT, HV), float("nan"), device=DEVICE)
    kd, bd, gd = k.to(DEVICE), beta.to(DEVICE), g.to(DEVICE)
    chunk_fwd.prepare(kd, torch.zeros(T, HV, K, device=DEVICE, dtype=dtype), gd, bd, ch, wu=False, gamma_out=G,
                      bound_out=bnd)
    nw = split.warm_plan(bnd, G, sg, ch, HV, after=after).cpu()
    walks = warm_walks(k, beta, g, cu, sg.cu.tolist(), sg.seq.tolist(), HV, after)
    for (s, hv), (expect, near) in walks.items():
        assert int(nw[s, hv]) == expect or near, (s, hv, int(nw[s, hv]), expect)
    longest = max(n for n, _ in walks.values())
    assert longest > 16


# ------------------------------------------------------------------------------- fused prologue
#: (B, T, H, HV, K, V, allow_neg_eigval)
FUSED = [(2, 300, 2, 4, 128, 128, False), (1, 65, 1, 2, 60, 100, False), (1, 65, 1, 2, 60, 100, True)]
FUSED_DRAWS = 4
_RAW = ("q", "k", "v", "a", "b", "A_log", "dt_bias")


@functools.lru_cache(maxsize=1)
def fused_errors(B, T, H, HV, K, V, neg, *, seed=99, draws=FUSED_DRAWS, device=DEVICE, triton_backend="triton"):
    """Pooled relative errors of :func:`gdn.ops.gated_delta_rule_fused` per path ("float32" and
    "bfloat16" on ``triton_backend``; "bfloat16 chunk", the PyTorch prologue and chunk form on the
    same bf16 inputs) against the float64 naive path (the PyTorch prologue and the token-by-token
    recurrence). The gradients of A_log and dt_bias have HV entries each, so one draw's relative
    error is a sample of a handful of numbers: ‖x − ref‖² and ‖ref‖² are summed over ``draws``
    independent draws for every path alike before the ratio is taken. The parameters and the
    initial state stay fp32 in the half-precision runs."""
    acc: dict = {}  # (path, key) -> [Σ‖x − ref‖², Σ‖ref‖²]
    wide = ("A_log", "dt_bias", "initial_state")
    for draw_i in range(draws):
        gen = torch.Generator(device=device).manual_seed(seed + 1000 * draw_i)

        def r(*s):
            return torch.randn(*s, generator=gen, device=device).double()

        d = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, HV, V), "a": r(B, T, HV), "b": r(B, T, HV),
             "A_log": r(HV) * 0.5, "dt_bias": r(HV) * 0.5, "initial_state": r(B, HV, K, V) * 0.3}
        do = torch.randn(B, T, HV, V, generator=gen, device=device, dtype=torch.float64)
        dS = torch.randn(B, HV, K, V, generator=gen, device=device, dtype=torch.float64)

        def run(dtype, backend):
            def call(xs):
                return ops.gated_delta_rule_fused(*[xs[n] for n in _RAW], initial_state=xs["initial_state"],
                                                  output_final_state=True, allow_neg_eigval=neg, backend=backend)
            return outputs_and_grads(call, leaves(d, dtype, wide), do, dS)

        ref = run(torch.float64, "naive")
        for path, got in (("float32", run(torch.float32, triton_backend)),
                          ("bfloat16", run(torch.bfloat16, triton_backend)),
                          ("bfloat16 chunk", run(torch.bfloat16, "chunk"))):
            for k in ref:
                x, y = got[k].detach().double(), ref[k].detach().double()
                e = acc.setdefault((path, k), [0.0, 0.0])
                e[0] += float((x - y).norm() ** 2) if torch.isfinite(x).all() else float("inf")
                e[1] += float(y.norm() ** 2)
    out: dict = {}
    for (path, k), (num, den) in acc.items():
        out.setdefault(path, {})[k] = (num / den) ** 0.5 if den > 0 else num ** 0.5
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("B,T,H,HV,K,V,neg", FUSED,
                         ids=[f"B{s[0]}-T{s[1]}-H{s[2]}-HV{s[3]}-K{s[4]}-V{s[5]}" + ("-neg" if s[6] else "")
                              for s in FUSED])
def test_fused_prologue(B, T, H, HV, K, V, neg, dtype):
    """The Triton prologue (L2 norm of q and k, g, β in kernels) and chunk kernels: outputs, final
    state and the gradients of q, k, v, a, b, A_log, dt_bias and the initial state."""
    errs = fused_errors(B, T, H, HV, K, V, neg)
    name = dtype_id(dtype)
    bounds = ({k: FP32_TOL for k in errs[name]} if dtype == torch.float32
              else {k: 2 * errs["bfloat16 chunk"][k] for k in errs[name]})
    assert_within(errs[name], bounds, f"gated_delta_rule_fused {(B, T, H, HV, K, V)} neg={neg}, {name}, "
                                      f"{FUSED_DRAWS} draws pooled")
