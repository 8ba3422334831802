"""Tier 3 on the CPU: the chunkwise Triton KDA kernels (gdn.ops.kda.triton.chunk) under Triton's
interpreter against the float64 recurrence (gdn.ops.kda.reference).

Outputs, final state and every gradient (q, k, v, g, beta, initial state; through o and the
final state) at small awkward shapes: T ∈ {1, 63, 65, 130} (one token, a partial chunk, a chunk
and a token, several chunks), K, V ∈ {16, 60} (60 is padded to 64), grouped value heads HV = 2H,
packed sequences with empty and one-token members, strong per-channel decay (exponents that would
overflow if the pairwise decay were factored through the chunk start). fp32 and fp16 (tl.dot on
bf16 is broken in the 3.6 interpreter: bf16 is checked on the GPU by tests/gpu).
"""
from __future__ import annotations

import contextlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from gdn.ops.kda import reference as KR  # noqa: E402
from gdn.ops import tuning  # noqa: E402
from gdn.ops.tuning import INTERPRET  # noqa: E402

from .helpers import rel_err, spy_group_sum  # noqa: E402
from .test_kda import kda_inputs  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET was set in this process", allow_module_level=True)

from gdn.ops.kda.triton.chunk import chunk_kda  # noqa: E402
from gdn.ops.triton import common  # noqa: E402
from gdn.ops.triton import launch as L  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _errors(B, T, H, HV, K, V, dtype, lens=None, state=True, g_scale=0.5, seed=0, g_edit=None):
    """Relative errors of o, the final state and every gradient against the float64 recurrence
    (``g_edit(g)``: changes the log decays [B, T, HV, K] in place first)."""
    N = len(lens) if lens else B
    d = kda_inputs(B, T, H, HV, K, V, N=N, g_scale=g_scale, seed=seed)
    if g_edit is not None:
        g_edit(d["g"])
    names = [n for n in NAMES if state or n != "initial_state"]
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    ref = {n: d[n].detach().clone().requires_grad_(True) for n in names}
    o_r, S_r = KR.kimi_delta_attention(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"],
                                       initial_state=ref.get("initial_state"), output_final_state=True, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(seed + 7)
    do = torch.randn(o_r.shape, generator=gen, dtype=torch.float64)
    dS = torch.randn(S_r.shape, generator=gen, dtype=torch.float64)
    ((o_r * do).sum() + (S_r * dS).sum()).backward()
    got = {n: d[n].detach().to(torch.float32 if n in ("initial_state", "g", "beta") else dtype)
           .clone().requires_grad_(True) for n in names}
    o, S = chunk_kda(got["q"], got["k"], got["v"], got["g"], got["beta"], initial_state=got.get("initial_state"),
                     output_final_state=True, cu_seqlens=cu)
    assert o.dtype == dtype and o.shape == o_r.shape
    assert S.dtype == torch.float32 and S.shape == S_r.shape
    ((o.double() * do).sum() + (S.double() * dS).sum()).backward()
    errs = {"o": rel_err(o, o_r), "S": rel_err(S, S_r)}
    errs.update({"d" + n: rel_err(got[n].grad, ref[n].grad) for n in names})
    for n in names:
        assert got[n].grad.dtype == got[n].dtype and got[n].grad.shape == got[n].shape, n
    return errs


def _check(errs, tol):
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_T65_grouped(dtype):
    _check(_errors(1, 65, 1, 2, 16, 60, dtype, seed=1), TOL[dtype])


@pytest.mark.parametrize("T,K,V", [(1, 60, 16), (63, 16, 60), (130, 60, 60)])
def test_lengths_and_padded_dims(T, K, V):
    _check(_errors(2 if T < 100 else 1, T, 1, 2, K, V, torch.float32, seed=T), TOL[torch.float32])


@pytest.mark.parametrize("state", [True, False], ids=["state", "no_state"])
def test_packed_with_empty_and_one_token_sequences(state):
    _check(_errors(1, 130, 1, 2, 16, 16, torch.float32, lens=[0, 1, 69, 0, 60], state=state, seed=2),
           TOL[torch.float32])


def test_packed_fp16():
    _check(_errors(1, 130, 2, 4, 16, 16, torch.float16, lens=[64, 1, 65], seed=3), TOL[torch.float16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tma", [True, False], ids=["descriptors", "pointers"])
def test_state_fwd_forms(dtype, tma, monkeypatch):
    """The forward state pass with its copies through tensor descriptors (``KDA["state_fwd"]["TMA"]``,
    taken on GPUs that have them) and through pointers: packed with a partial, a one-token, an empty
    and a full sequence (a chunk's 64-row block reaches into the next sequence's rows, which must
    add nothing), grouped value heads, initial and final states; the launches take the form asked
    for."""
    from gdn.ops.kda.triton import chunk_fwd

    monkeypatch.setitem(tuning.KDA, "state_fwd", dict(tuning.KDA["state_fwd"], TMA=tma))
    seen, real = [], chunk_fwd.launch

    def spy(kernel, grid, *args, name, io, **meta):
        if name == "state_fwd":
            seen.append(meta["TMA"])
        return real(kernel, grid, *args, name=name, io=io, **meta)

    monkeypatch.setattr(chunk_fwd, "launch", spy)
    _check(_errors(1, 194, 1, 2, 16, 16, dtype, lens=[65, 1, 0, 128], seed=18), TOL[dtype])
    assert seen and all(t == tma for t in seen), seen


def test_strong_decay_stays_finite_and_accurate():
    """g down to −40 per token and channel: the in-chunk cumulative decay reaches thousands of nats,
    so any exp(−γ) factored through the chunk start would overflow; the sub-block form never
    takes a positive exponent."""
    errs = _errors(1, 130, 1, 1, 16, 16, torch.float32, g_scale=40.0, seed=4)
    _check(errs, 1e-4)


def test_decay_around_the_diagonal_blocks_span():
    """Diagonal 16-row blocks go through their first row while no channel decays by more than
    SPAN nats across the block, else through pairwise exponents. Here one chunk mixes both: tokens
    20–40 decay by 12 nats per token in half the channels (blocks 1 and 2 take the pairwise form),
    and the rest by 3.8 per token in one channel (≈ 57 nats across a block, just under SPAN: the
    first-row form with column factors near e^57)."""
    from gdn.ops.kda.triton.chunk_fwd import SPAN

    assert 15 * 3.8 < SPAN < 15 * 12

    def edit(g):
        g[:, :, :, 0] = -3.8
        g[:, 20:41, :, 8:] = -12.0

    _check(_errors(1, 130, 1, 2, 16, 16, torch.float32, seed=5, g_edit=edit), 1e-4)


def test_fp16_decay_past_its_range_within_a_block():
    """fp16 dot operands hold at most e^11.1: one channel decaying by 2 nats a token (30 nats across
    a block, under SPAN but past fp16's range) takes the pairwise form in fp16 instead of
    overflowing in the first-row form."""
    from gdn.ops.kda.triton.chunk_fwd import SPAN, SPAN_FP16

    assert SPAN_FP16 < 15 * 2.0 < SPAN and 2 ** 16 < torch.exp(torch.tensor(15 * 2.0))

    def edit(g):
        g[:, :, :, 0] = -2.0

    _check(_errors(1, 130, 1, 2, 16, 16, torch.float16, seed=9, g_edit=edit), TOL[torch.float16])


def _count_launches(monkeypatch) -> list:
    """The names of the forward module's launches from now on, in order (they still run)."""
    from gdn.ops.kda.triton import chunk_fwd as F

    names = []
    launch = F.launch

    def counting(kernel, grid, *args, name, **kw):
        names.append(name)
        return launch(kernel, grid, *args, name=name, **kw)

    monkeypatch.setattr(F, "launch", counting)
    return names


def test_backward_reuses_the_forwards_inverse(monkeypatch):
    """The forward saves T⁻¹ and P: a forward + backward launches kkt once (wu and the state pass
    twice: the backward recomputes them), and the gradients still match the recurrence."""
    names = _count_launches(monkeypatch)
    _check(_errors(1, 65, 1, 2, 16, 16, torch.float32, seed=6), TOL[torch.float32])
    assert names.count("kkt") == 1 and names.count("wu") == 2 and names.count("state_fwd") == 2, names


@pytest.mark.parametrize("g_scale", [0.5, 40.0], ids=["mild", "strong"])
def test_kkt_both_diagonal_forms(monkeypatch, g_scale):
    """kkt_kernel against the reference: grouped heads, partial chunks, both diagonal forms (strong
    decay takes the pairwise rewrite in every block), and (once) the span test's mixed chunk."""
    names = _count_launches(monkeypatch)
    _check(_errors(1, 130, 1, 2, 16, 16, torch.float32, g_scale=g_scale, seed=8), 1e-4)
    assert names.count("kkt") == 1, names
    if g_scale > 1:
        return

    def edit(g):
        g[:, :, :, 0] = -3.8
        g[:, 20:41, :, 8:] = -12.0

    _check(_errors(1, 130, 1, 2, 16, 16, torch.float32, seed=5, g_edit=edit), 1e-4)


def test_no_final_state_and_no_grad():
    d = kda_inputs(1, 70, 1, 2, 16, 16, dtype=torch.float32)
    with torch.no_grad():
        o, S = chunk_kda(d["q"], d["k"], d["v"], d["g"], d["beta"])
    o_r, _ = KR.kimi_delta_attention(*(d[n].double() for n in ("q", "k", "v", "g", "beta")))
    assert S is None and rel_err(o, o_r) < TOL[torch.float32]


def test_gradients_without_final_state_and_state():
    """No final state asked for (the backward gets no state gradient), no initial state; T = 64,
    exactly one chunk."""
    d = kda_inputs(1, 64, 1, 2, 16, 16, dtype=torch.float64, seed=5)
    names = ("q", "k", "v", "g", "beta")
    ref = {n: d[n].clone().requires_grad_(True) for n in names}
    got = {n: d[n].float().clone().requires_grad_(True) for n in names}
    o_r, _ = KR.kimi_delta_attention(*(ref[n] for n in names))
    o, S = chunk_kda(*(got[n] for n in names))
    do = torch.randn(o_r.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    (o_r * do).sum().backward()
    (o.double() * do).sum().backward()
    assert S is None and rel_err(o, o_r) < TOL[torch.float32]
    for n in names:
        assert rel_err(got[n].grad, ref[n].grad) < TOL[torch.float32], n


def test_half_gradients_come_out_of_the_kernels_rounded_once():
    """With one value head per key head and half inputs, the backward writes dq, dk and dv in the
    inputs' dtype from the kernels that finish them: each equals the fp32 result rounded once, so
    the caller casts nothing."""
    from gdn.ops.kda.triton import chunk_bwd, chunk_fwd  # noqa: PLC0415

    d = kda_inputs(1, 130, 2, 2, 32, 32, dtype=torch.float16, seed=3)
    q, k, v = (d[n].reshape(130, 2, 32) for n in ("q", "k", "v"))
    g, beta = d["g"].float().reshape(130, 2, 32), d["beta"].float().reshape(130, 2)
    ch = common.make_chunks(1, 130, None, q.device)
    G = chunk_fwd.gamma(g, ch)
    do = torch.randn(130, 2, 32, generator=torch.Generator().manual_seed(4)).half()
    wide = chunk_bwd.backward(q, k, v, G, beta, None, do, None, ch, 32 ** -0.5)
    half = chunk_bwd.backward(q, k, v, G, beta, None, do, None, ch, 32 ** -0.5, grad_dtype=torch.float16)
    for name, w, h in zip(("dq", "dk", "dv"), wide[:3], half[:3]):
        assert w.dtype == torch.float32 and h.dtype == torch.float16, name
        assert w.abs().max() > 0, name
        assert torch.equal(h, w.half()), name
    for w, h in zip(wide[3:5], half[3:5]):
        assert torch.equal(w, h)


def test_rejects_head_dims_beyond_256():
    d = kda_inputs(1, 2, 1, 1, 16, 264, dtype=torch.float32)
    with pytest.raises(ValueError, match="V <= 256"):
        chunk_kda(d["q"], d["k"], d["v"], d["g"], d["beta"])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("T,H,HV,K,V", [(200, 2, 4, 60, 60), (65, 1, 2, 128, 32), (130, 1, 1, 256, 16)])
def test_sweep(T, H, HV, K, V, dtype):
    _check(_errors(1, T, H, HV, K, V, dtype, seed=T + K), TOL[dtype])



def test_precompile_records_every_kernel_once_per_kind(monkeypatch, caplog):
    """The first CUDA call's dry run (kda_chunk.dry_run under launch.precompile) reaches every
    kernel of a forward and backward, launches none of them, and runs once per key; the compile
    step is replaced by a recorder here (the interpreter has nothing to compile)."""
    from gdn.ops.kda.triton import chunk_bwd as Bw
    from gdn.ops.kda.triton import chunk_fwd as F
    from gdn.ops.triton.common import make_chunks
    from gdn.ops.kda.triton.chunk import dry_run

    from gdn.ops.triton import launch as C

    warmed, built = [], []

    class Compiled:  # what warmup hands back: a compiled kernel and its source
        def __init__(self, name):
            self.src = name
            warmed.append(name)

    monkeypatch.setattr(C, "INTERPRET", False)
    monkeypatch.setattr(C, "_WARM", set())
    monkeypatch.setattr(triton, "AsyncCompileMode", lambda ex: contextlib.nullcontext())
    monkeypatch.setattr(C, "build_launcher", lambda ck: built.append(ck.src))
    for kernel in {k for mod in (F, Bw) for k in vars(mod).values() if hasattr(k, "warmup")}:
        monkeypatch.setattr(kernel, "warmup", lambda *a, _k=kernel, **kw: Compiled(_k.fn.__name__))
    d = kda_inputs(1, 70, 1, 2, 16, 16, dtype=torch.float32)
    T, HV = 70, 2
    args = (d["q"].reshape(T, 1, 16), d["k"].reshape(T, 1, 16), d["v"].reshape(T, HV, 16),
            d["g"].reshape(T, HV, 16), d["beta"].reshape(T, HV), d["initial_state"],
            make_chunks(1, T, None, torch.device("cpu")), True, 0.25)
    for _ in range(2):
        C.precompile("key", lambda: dry_run(*args))
    assert C._RECORD is None
    expected = {"gamma_kernel", "kkt_kernel", "solve_kernel", "wu_kernel", "state_fwd_kernel", "output_kernel", "dv_local_kernel",
                "state_bwd_kernel", "dqk_kernel", "wy_bwd_kernel", "intra_bwd_kernel"}
    # the backward recomputes wu and the state pass, which compiles each of its candidates (waves)
    from gdn.ops.kda.triton.chunk_fwd import entry

    n_state = len(entry("state_fwd", torch.float32)["stages"])
    assert set(warmed) == expected and len(warmed) == 11 + 2 * n_state
    assert sorted(built) == sorted(warmed)  # and each compiled kernel's launcher built there too

    def fail(ck):
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(C, "build_launcher", fail)  # launchers left to the first launch, quietly
    with caplog.at_level("WARNING", logger=C.log.name):
        C.precompile("another key", lambda: dry_run(*args))
    assert len(warmed) == 2 * (11 + 2 * n_state) and not caplog.records


def test_entry_takes_the_overrides_of_the_input_dtype(monkeypatch):
    """A KDA table entry's ``fp32`` and ``fp16`` dicts override it for those inputs only."""
    from gdn.ops.kda.triton.chunk_fwd import entry

    monkeypatch.setitem(tuning.KDA, "probe", dict(BK=64, PREC="tf32", fp32=dict(BK=32, PREC="tf32x3"),
                                                  fp16=dict(PREC="ieee")))
    got = {dt: (entry("probe", dt)["BK"], entry("probe", dt)["PREC"])
           for dt in (torch.bfloat16, torch.float16, torch.float32)}
    assert got == {torch.bfloat16: (64, "tf32"), torch.float16: (64, "ieee"), torch.float32: (32, "tf32x3")}
    assert entry("intra_bwd", torch.float16)["PREC"] == "tf32x3" != entry("intra_bwd", torch.bfloat16)["PREC"]


@pytest.mark.parametrize("name,programs,want", [
    # per_sm 1 (state_bwd, value tiles of 128): halved only while twice the programs fit one wave
    ("state_bwd", 128, 128), ("state_bwd", 64, 64), ("state_bwd", 16, 32),
    # per_sm 2 (state_fwd, value tiles of 64): halved while twice the programs fit two per multiprocessor
    ("state_fwd", 128, 64), ("state_fwd", 64, 32), ("state_fwd", 256, 64),
])
def test_state_vtile_sizes_the_grid_to_one_wave(monkeypatch, name, programs, want):
    """The sequential passes' value tile at K = V = 128 bf16 on a card of 132 multiprocessors."""
    from gdn.ops.kda.triton import chunk_fwd as F

    monkeypatch.setattr(F, "sm_count", lambda device: 132)
    monkeypatch.setitem(tuning.KDA, "state_bwd", dict(tuning.KDA["state_bwd"], SV=16384, BV_min=32, per_sm=1))
    monkeypatch.setitem(tuning.KDA, "state_fwd", dict(tuning.KDA["state_fwd"], SV=8192, BV_min=32, per_sm=2))
    assert F.state_vtile(name, 128, 128, programs, None, torch.bfloat16) == want


def test_grouped_heads_sum_partials_in_the_input_dtype(monkeypatch):
    """Half-precision grouped heads: the backward's per-value-head dq and dk come in the inputs'
    dtype and each group is summed in fp32 by common.group_sum, within the fp16 tolerance."""
    from gdn.ops.kda.triton import chunk as kda_chunk  # noqa: PLC0415

    seen = spy_group_sum(monkeypatch, kda_chunk)
    _check(_errors(1, 65, 1, 4, 16, 16, torch.float16, seed=5), TOL[torch.float16])
    assert seen == [(torch.float16, 4), (torch.float16, 4)], seen
