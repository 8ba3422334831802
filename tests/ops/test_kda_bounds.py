"""Out-of-bounds harness for the chunkwise Triton KDA kernels (gdn.ops.kda.triton.chunk*), under
Triton's CPU interpreter.

The interpreter does not fault on an address outside a tensor, so every tensor the kernels touch is
placed as a view in the middle of a larger buffer whose guard regions, on both sides, hold a NaN
with a recognisable bit pattern: the inputs q, k, v, g, β, the initial state and the cotangents
(through the public entry, with the wrapper's padding helper patched to return guarded copies), the
chunk index tensors (guarded by a huge integer), and every buffer the launchers allocate
(``torch.empty`` / ``torch.empty_like`` of the KDA chunk_fwd and chunk_bwd modules patched), whose own
interior also starts as NaN. After a forward and a backward:

(a) no NaN in the output, the final state, any gradient or any launcher buffer (a read beyond a
    tensor, or of an element no kernel wrote, brings a NaN in: NaN · 0 is NaN);
(b) every guard region holds its exact bit pattern (no write beyond a tensor);
(c) the results match the float64 recurrence (so the guarded run computed the real thing).

The multiprocessor count is patched to the H200's 132: the sequential passes then halve their V
tile down to ``BV_min`` as on the GPU (with the interpreter's default of 4 they never do, so the
other CPU tests never run the GPU's tile choice).
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from gdn.ops.kda import reference as KR  # noqa: E402
from gdn.ops import tuning  # noqa: E402
from gdn.ops.tuning import INTERPRET  # noqa: E402

from .helpers import rel_err  # noqa: E402
from .test_kda import kda_inputs  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET was set in this process", allow_module_level=True)

from gdn.ops.kda.triton import chunk as kda_chunk  # noqa: E402
from gdn.ops.triton import common  # noqa: E402
from gdn.ops.triton import launch as L  # noqa: E402
from gdn.ops.kda.triton import chunk_bwd as kda_chunk_bwd  # noqa: E402
from gdn.ops.kda.triton import chunk_fwd as kda_chunk_fwd  # noqa: E402

#: Guard bit patterns per float dtype: (integer view, quiet-NaN base, payload bits, finite base). The
#: n-th buffer's guards hold base | (n mod payload), so a value read out of one buffer's guard and
#: written into another's still changes the latter's bits.
BITS = {torch.float32: (torch.int32, 0x7FC00000, 1 << 20, 0x3E000000),
        torch.float16: (torch.int16, 0x7E00, 1 << 8, 0x3800),
        torch.bfloat16: (torch.int16, 0x7FC0, 1 << 5, 0x3E00)}
INT_GUARD = 0x3FFFFFFF
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


class Guarded:
    """Allocates tensors as views in the middle of guarded buffers and checks the guards. With
    ``nan`` the guards (and the interior of fresh buffers) hold NaNs: an out-of-bounds read shows as
    a NaN in the results. Without, they hold finite values: an out-of-bounds write of a NaN read
    from a guard, or of anything in place (x[i] = x[i] + …), shows as changed guard bits."""

    def __init__(self, nan=True):
        self.nan = nan
        self.buffers = []  # (name, big buffer, first element, element count, view, bits)

    def alloc(self, shape, dtype, name):
        n = 1
        for s in shape:
            n *= int(s)
        pad = max(1024, -(-n // 16) * 16)  # at least a whole tensor's worth on each side, 64-byte aligned
        big = torch.empty(n + 2 * pad, dtype=dtype)
        if dtype in BITS:
            itype, nan_base, payload, finite_base = BITS[dtype]
            bits = (nan_base if self.nan else finite_base) | (1 + len(self.buffers) % (payload - 1))
            big.view(itype).fill_(bits)
        else:
            bits = INT_GUARD
            big.fill_(bits)
        view = big[pad:pad + n].view(*shape)
        self.buffers.append((name, big, pad, n, view, bits))
        return view

    def copy(self, x, name):
        """A guarded contiguous copy of x (same dtype and shape)."""
        out = self.alloc(tuple(x.shape), x.dtype, name)
        out.copy_(x)
        return out

    def guard_faults(self):
        """Names of buffers whose guard regions changed (a write out of bounds)."""
        bad = []
        for name, big, pad, n, _, bits in self.buffers:
            raw = big.view(BITS[big.dtype][0]) if big.dtype in BITS else big
            if not (bool((raw[:pad] == bits).all()) and bool((raw[pad + n:] == bits).all())):
                bad.append(name)
        return bad

    def nan_buffers(self, prefix):
        """Names of the buffers named ``prefix…`` whose interior holds a NaN."""
        return [name for name, big, _, _, view, _ in self.buffers
                if name.startswith(prefix) and big.is_floating_point() and bool(torch.isnan(view).any())]


class _TorchWithGuardedEmpty:
    """The ``torch`` module as the launcher modules see it, with empty / empty_like guarded."""

    def __init__(self, guarded, tag):
        self._g, self._tag, self._count = guarded, tag, 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def _name(self):
        self._count += 1
        return f"buf:{self._tag}#{self._count}"

    def empty(self, *shape, device=None, dtype=None):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        return self._g.alloc(shape, dtype or torch.float32, self._name())

    def empty_like(self, x, dtype=None):
        return self._g.alloc(tuple(x.shape), dtype or x.dtype, self._name())


def guarded_run(monkeypatch, B, T, H, HV, K, V, dtype, lens=None, state=True, sms=132, seed=0, g_scale=0.5,
                nan=True):
    """Forward + backward of kda_chunk.chunk_kda with every tensor guarded (NaN guards or finite
    ones, see :class:`Guarded`); returns (guards, relative errors against the float64 recurrence)."""
    gd = Guarded(nan)
    monkeypatch.setattr(kda_chunk_fwd, "torch", _TorchWithGuardedEmpty(gd, "fwd"))
    monkeypatch.setattr(kda_chunk_bwd, "torch", _TorchWithGuardedEmpty(gd, "bwd"))
    monkeypatch.setattr(kda_chunk_fwd, "sm_count", lambda device: sms)
    pads = iter(range(1000))
    orig_pad = kda_chunk.pad_zeros
    monkeypatch.setattr(kda_chunk, "pad_zeros",
                        lambda x, *p: None if x is None else gd.copy(orig_pad(x, *p), f"in:pad#{next(pads)}"))
    orig_chunks = kda_chunk.make_chunks

    def chunks(*a, **kw):
        ch = orig_chunks(*a, **kw)
        return common.Chunks(gd.copy(ch.cu, "in:cu"), gd.copy(ch.chunk_idx, "in:chunk_idx"),
                              gd.copy(ch.chunk_off, "in:chunk_off"), ch.N, ch.NT, ch.T, ch.max_nc, ch.host_cu,
                              ch.host_per)

    monkeypatch.setattr(kda_chunk, "make_chunks", chunks)

    N = len(lens) if lens else B
    d = kda_inputs(B, T, H, HV, K, V, N=N, g_scale=g_scale, seed=seed)
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if state or n != "initial_state"]
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    ref = {n: d[n].detach().clone().requires_grad_(True) for n in names}
    o_r, S_r = KR.kimi_delta_attention(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"],
                                       initial_state=ref.get("initial_state"), output_final_state=True, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(seed + 7)
    do = torch.randn(o_r.shape, generator=gen, dtype=torch.float64)
    dS = torch.randn(S_r.shape, generator=gen, dtype=torch.float64)
    ((o_r * do).sum() + (S_r * dS).sum()).backward()
    got = {n: gd.copy(d[n].to(torch.float32 if n in ("initial_state", "g", "beta") else dtype), "in:" + n)
           .detach().requires_grad_(True) for n in names}
    o, S = kda_chunk.chunk_kda(got["q"], got["k"], got["v"], got["g"], got["beta"],
                               initial_state=got.get("initial_state"), output_final_state=True, cu_seqlens=cu)
    # the cotangents arrive as guarded views too (in the output dtype; the wrapper pads V when needed)
    do_g, dS_g = gd.copy(do.to(o.dtype), "in:do"), gd.copy(dS.float(), "in:dS")
    torch.autograd.backward([o, S], [do_g, dS_g])
    errs = {"o": rel_err(o, o_r), "S": rel_err(S, S_r)}
    errs.update({"d" + n: rel_err(got[n].grad, ref[n].grad) for n in names})
    return gd, errs


def check(monkeypatch, *args, tol, **kw):
    """:func:`guarded_run` with NaN guards, then with finite ones: no write beyond any tensor, no
    NaN in any launcher buffer (NaN pass), results within ``tol`` of the float64 recurrence."""
    for nan in (True, False):
        gd, errs = guarded_run(monkeypatch, *args, nan=nan, **kw)
        mode = "NaN" if nan else "finite"
        assert not gd.guard_faults(), f"{mode} guards: writes out of bounds into {gd.guard_faults()}"
        if nan:
            assert not gd.nan_buffers("buf:"), f"NaN (read out of bounds or of an unwritten element) in " \
                                               f"{gd.nan_buffers('buf:')}"
        assert all(v <= tol for v in errs.values()), (mode, errs)


def test_guards_catch_an_out_of_bounds_write_and_read(monkeypatch):
    """The harness itself: a kernel writing one row past its tensor trips the guard check, and one
    reading a row past it brings a NaN in."""
    import triton.language as tl

    @triton.jit
    def shift(x, y, n, OFF: tl.constexpr):
        o = tl.arange(0, 16)
        tl.store(y + o + OFF, tl.load(x + o + OFF, mask=o < n, other=0.0), mask=o < n)

    @triton.jit
    def accumulate(y, OFF: tl.constexpr):
        o = tl.arange(0, 16) + OFF
        tl.store(y + o, tl.load(y + o) + 1.0)

    gd = Guarded()
    x = gd.copy(torch.ones(16), "in:x")
    y = gd.alloc((16,), torch.float32, "buf:y")
    shift[(1,)](x, y, 16, OFF=0)
    assert not gd.guard_faults() and not gd.nan_buffers("buf:")
    shift[(1,)](x, y, 16, OFF=1)  # reads x[16] (x's guard NaN) and writes it to y[16] (y's guard)
    assert gd.guard_faults() == ["buf:y"] and gd.nan_buffers("buf:") == []
    z = gd.alloc((16,), torch.float32, "buf:z")
    shift[(1,)](x, z, 15, OFF=1)  # writes z[1..15] only: z[0] keeps its NaN, an unwritten element
    assert gd.nan_buffers("buf:") == ["buf:z"]
    gd = Guarded(nan=False)
    y = gd.alloc((16,), torch.float32, "buf:y")
    accumulate[(1,)](y, OFF=0)
    assert not gd.guard_faults()
    accumulate[(1,)](y, OFF=1)  # y[16] += 1 in place: NaN guards would keep their bits, finite ones do not
    assert gd.guard_faults() == ["buf:y"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_partial_chunks_grouped_heads_gpu_tiles(monkeypatch, dtype):
    """T = 65 (a chunk and a token), K = 20 (padded to 32), V = 32, HV = 2H, the H200's V tiles."""
    check(monkeypatch, 1, 65, 1, 2, 20, 32, dtype, seed=1, tol=TOL[dtype])


def test_packed_with_empty_and_one_token_members(monkeypatch):
    """One token, an empty sequence, a whole chunk, a chunk and a token (a partial 16-row block), a
    partial chunk; K = 20 (padded), grouped value heads; the H200's tiles."""
    check(monkeypatch, 1, 148, 1, 2, 20, 32, torch.float32, lens=[1, 0, 64, 65, 18, 0], seed=2,
          tol=TOL[torch.float32])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("H", [1, 2])
def test_first_gpu_failure_case(monkeypatch, H, dtype):
    """The case that faulted on the H200 (the first GPU check of the KDA chunk kernels): T = 130, K = 100
    (padded to 128), V = 128, HV = 2H."""
    check(monkeypatch, 1, 130, H, 2 * H, 100, 128, dtype, seed=3, tol=TOL[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("sms", [4, 132])
@pytest.mark.parametrize("T", [1, 63, 64, 65])
@pytest.mark.parametrize("KV", [(16, 16), (32, 60), (60, 32), (64, 64), (100, 128), (128, 100)])
def test_sweep(monkeypatch, T, KV, sms):
    K, V = KV
    check(monkeypatch, 2, T, 1, 2, K, V, torch.float32, sms=sms, seed=T + K, tol=TOL[torch.float32])


@pytest.mark.slow
@pytest.mark.parametrize("state", [True, False], ids=["state", "no_state"])
def test_sweep_packed(monkeypatch, state):
    check(monkeypatch, 1, 400, 2, 4, 60, 128, torch.float32, lens=[1, 200, 64, 0, 135], state=state, seed=5,
          tol=TOL[torch.float32])


@pytest.mark.parametrize("K,V,sms", [(100, 128, 132), (16, 16, 132), (256, 256, 132), (60, 60, 4)])
def test_no_tile_narrower_than_32_but_the_sub_blocks(monkeypatch, K, V, sms):
    """The fix for the first H200 fault's suspect: every launch of a forward + backward sees K, V ≥
    32 and, but for the 16-row sub-block kernels (kkt's K tile), K and V tiles ≥ 32; in particular
    the sequential passes no longer halve their V tile to 16 when the programs do not fill the
    card (4 programs at the failing case: T = 130, H = 2, HV = 4, K = 100, V = 128)."""
    monkeypatch.setattr(kda_chunk_fwd, "sm_count", lambda device: sms)
    T, H, HV = 130, 2, 4
    Kp, Vp = common.pow2(K, tuning.MIN_DIM), common.pow2(V, tuning.MIN_DIM)
    q, k = torch.zeros(T, H, Kp), torch.zeros(T, H, Kp)
    v, g, beta = torch.zeros(T, HV, Vp), torch.zeros(T, HV, Kp), torch.zeros(T, HV)
    ch = common.make_chunks(1, T, None, torch.device("cpu"))
    with L.recording() as launches:
        kda_chunk.dry_run(q, k, v, g, beta, torch.zeros(1, HV, Kp, Vp), ch, True, 1.0)
    assert Kp >= 32 and Vp >= 32
    seen = set()
    for kernel, grid, args, meta in launches:
        name = kernel.fn.__name__
        seen.add(name)
        assert meta.get("K", 32) >= 32 and meta.get("V", 32) >= 32, (name, meta)
        assert meta.get("BV", 32) >= 32, (name, meta)
        assert meta.get("BK", 32) >= 32, (name, meta)
    assert {"state_fwd_kernel", "state_bwd_kernel", "kkt_kernel", "intra_bwd_kernel"} <= seen
