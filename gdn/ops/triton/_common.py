"""Shared pieces of the Triton chunk kernels: chunk bookkeeping for packed sequences, dot precision.

Every launcher works on the packed layout: ``[B, T, ...]`` inputs are viewed as one stream of
``B·T`` tokens with offsets ``cu = [0, T, 2T, …]``, so batched and packed calls run the same
kernels. Sequences are cut into chunks of ``BT = 64`` tokens starting at each sequence's first
token (no chunk straddles two sequences); ``chunk_idx[i] = (n, c)`` names the sequence and the
chunk inside it of global chunk ``i``, and ``chunk_off[n]`` is the global index of sequence n's
first chunk (where its states live in the per-chunk state buffer).
"""
from __future__ import annotations

import functools
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

BT = 64  # chunk size (tokens); also the size of the in-chunk triangular solve

# Triton's CPU interpreter (numpy ≥ 2) cannot run ``for`` loops with run-time bounds; under it the
# sequential passes loop with ``while`` instead (a compile-time switch: the GPU keeps ``for``,
# which the software pipeliner can prefetch across).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class Chunks:
    """Chunk layout of one call. Tensors live on the compute device (int32)."""

    cu: torch.Tensor  # [N + 1] token offsets
    chunk_idx: torch.Tensor  # [NT, 2] (sequence, chunk in sequence)
    chunk_off: torch.Tensor  # [N] first global chunk of each sequence
    N: int
    NT: int
    T: int  # total tokens (B·T)
    max_nc: int  # chunks of the longest sequence
    host_cu: torch.Tensor | None = None  # [N + 1] token offsets on the CPU (int64)
    host_per: torch.Tensor | None = None  # [N] chunks per sequence on the CPU (int64)


@dataclass(frozen=True)
class Segments:
    """Sequences cut into segments of at most ``L`` chunks, for the split state passes: each
    segment is a "sequence" of the state kernels (``cu``, ``off``, ``max_nc = L``); ``first[n]``
    and ``count[n]`` name sequence n's segments, in order. Tensors on the compute device (int32)."""

    cu: torch.Tensor  # [NS + 1] token offsets of the segments
    off: torch.Tensor  # [NS] global chunk index of each segment's first chunk
    first: torch.Tensor  # [N] first segment of each sequence
    count: torch.Tensor  # [N] segments of each sequence
    NS: int
    L: int  # chunks per segment (the last of a sequence may have fewer)
    max_ns: int  # segments of the longest sequence


def _to_device_many(arrays, device: torch.device) -> list[torch.Tensor]:
    """int32 copies of the host integer arrays on ``device`` in one transfer (one pinned buffer on
    CUDA, copied asynchronously: no host sync), as views of one device buffer. Each view starts on a
    16-byte boundary, so Triton sees the same pointer alignment whatever the sizes."""
    sizes = [len(a) for a in arrays]
    starts = np.cumsum([0] + [-(-n // 4) * 4 for n in sizes])
    buf = np.zeros(int(starts[-1]), dtype=np.int32)
    for a, s0, n in zip(arrays, starts, sizes):
        buf[s0:s0 + n] = np.asarray(a).reshape(-1)
    t = torch.from_numpy(buf)
    t = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
    return [t[s0:s0 + n] for s0, n in zip(starts, sizes)]


def make_segments(ch: "Chunks", L: int, device: torch.device) -> Segments:
    """Cut every sequence of ``ch`` into segments of ``L`` chunks (built on the host; no sync)."""
    per, cu = ch.host_per, ch.host_cu
    count = (per + L - 1) // L
    first = torch.zeros_like(count)
    if count.numel() > 1:
        first[1:] = torch.cumsum(count, 0)[:-1]
    NS = int(count.sum())
    seq = torch.from_numpy(np.repeat(np.arange(len(count)), count.numpy()))
    inner = torch.arange(NS) - first[seq]
    chunk_first = torch.zeros_like(per)
    if per.numel() > 1:
        chunk_first[1:] = torch.cumsum(per, 0)[:-1]
    off = chunk_first[seq] + inner * L
    bos = cu[:-1][seq] + inner * L * BT
    # a sequence's last segment ends at its own end, which is the next segment's start (or the total)
    ends = torch.minimum(bos + L * BT, cu[1:][seq])
    seg_cu = torch.cat([bos, ends[-1:]]) if NS else cu[-1:]
    assert NS == 0 or bool((seg_cu[1:-1] == ends[:-1]).all()), "segments must tile the token stream"
    d_cu, d_off, d_first, d_count = _to_device_many([t.numpy() for t in (seg_cu, off, first, count)], device)
    return Segments(d_cu, d_off, d_first, d_count, NS, L, int(count.max()) if NS else 0)


@functools.lru_cache(maxsize=64)
def _dense_chunks(B: int, T: int, device: torch.device) -> Chunks:
    """The chunk layout of B rows of T tokens, built once per (B, T, device): a call at a shape seen
    before launches no index kernels (the tensors are read-only to every kernel)."""
    n_per = triton.cdiv(T, BT)
    NT = B * n_per
    ar = torch.arange(NT, device=device, dtype=torch.int32)
    idx = torch.stack([ar // n_per, ar % n_per], dim=1).contiguous()
    cu = torch.arange(B + 1, device=device, dtype=torch.int32) * T
    off = torch.arange(B, device=device, dtype=torch.int32) * n_per
    return Chunks(cu, idx, off, B, NT, B * T, n_per, torch.arange(B + 1) * T, torch.full((B,), n_per))


def make_chunks(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> Chunks:
    """Chunk layout for ``B`` rows of ``T`` tokens, or for packed ``cu_seqlens`` (then B == 1).

    Needs no host synchronisation when ``cu_seqlens`` is None or lives on the CPU: the index
    tensors are built on the host and copied asynchronously (from pinned memory on CUDA).
    """
    if cu_seqlens is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return _dense_chunks.__wrapped__(B, T, device)  # made inside a graph: not reusable outside it
        return _dense_chunks(B, T, device)
    # host-side index arithmetic in numpy: single-threaded and fast (torch's CPU ops on a dozen
    # elements took milliseconds on a loaded many-core host, e.g. repeat_interleave)
    host = cu_seqlens.detach().to("cpu", torch.int64)
    h = host.numpy()
    per = (np.diff(h) + BT - 1) // BT
    N = len(per)
    off = np.zeros(N, dtype=np.int64)
    if N > 1:
        off[1:] = np.cumsum(per)[:-1]
    NT = int(per.sum())
    seq = np.repeat(np.arange(N), per)
    idx = np.stack([seq, np.arange(NT) - off[seq]], axis=1)
    d_cu, d_idx, d_off = _to_device_many([h, idx.reshape(-1), off], device)
    return Chunks(d_cu, d_idx.view(NT, 2), d_off, N, NT, int(h[-1]), int(per.max()) if N else 0, host,
                  torch.from_numpy(per))


def dot_precision(dtype: torch.dtype) -> str:
    """Tensor-core mode of fp32 dot operands: 3-pass tf32 (≈ fp32) for fp32 inputs. For half
    inputs every dot operand is cast to the input dtype first (native bf16/fp16 tensor-core dots with
    fp32 accumulation), so the mode does not apply; "tf32" is passed for form's sake."""
    return "tf32x3" if dtype in (torch.float32, torch.float64) else "tf32"


def tl_dtype(dtype: torch.dtype):
    """The Triton element type of the kernels' intermediates for inputs of ``dtype``: the input's
    own half type (as FLA), fp32 for fp32 inputs."""
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(dtype, tl.float32)


#: Launch configuration of each chunk kernel (warps, pipelining depths tried in order, tiles).
#: ``SV`` is the number of fp32 elements of one state tile in the sequential passes (the tile is
#: the whole K × SV/K values). Chosen by ``benchmarks/tune_gpu.py`` on the H200 (2026-11-30; the
#: candidates were within ±5 % of each other at K = V = 128 bf16).
CONFIG = {
    # kkt_solve: INV is the precision of the in-chunk inverse's fp32 dots for half inputs ("ieee":
    # FMA, exact fp32; "tf32x3": three tensor-core passes, ≈ fp32; "tf32": one); fp32 inputs: "ieee".
    # "tf32": 7–37 % faster forwards on the H200, results moved by ≈ 2e-3 relative (half of what bf16
    # inputs cost), within DESIGN §5 tier 3 at every case of benchmarks/gpu_check.py (2026-11-30)
    # two stages: 188 → 151 µs at (4, 8192, 16, 128) on the H200 (sixth session)
    "kkt_solve": dict(num_warps=2, stages=(2, 1), BK=64, BV=64, INV="tf32"),
    # wu: 8 warps. With 4, triton 3.6 on the H200 compiled a shared-memory access out of range at
    # K = 60/64, T = 63 (compute-sanitizer, benchmarks/gpu_repro_v16.py); 8 warps time the same.
    "wu": dict(num_warps=8, stages=(3, 2, 1), BK=64, BV=64),
    # state_fwd: SV halves (down to value tiles of BV_min) while the (sequence, head, tile) programs
    # would not fill the card (chunk_fwd.state_tile; tiles of 16 passed the GPU check, 2026-11-30);
    # measured on the H200: (1, 32768, 16, 128) fwd 1.78 → 1.63 ms. waves: the launch picks the
    # pipeline depth (and form) whose grid runs in the fewest waves (_common.by_waves)
    "state_fwd": dict(num_warps=4, stages=(3, 2, 1), waves=True, SV=8192, BV_min=16),
    # state_out: the forward's fused pass (state and output, chunk_fwd.forward), taken when its
    # programs number ≥ fill × the multiprocessors (chunk._forward); else state_fwd, then output.
    # No third stage: with one, the GPU check failed at T = 63, V = 16 bf16 (docs/TRITON.md)
    "state_out": dict(num_warps=4, stages=(2, 1), waves=True, SV=4096, fill=1.5, BV_min=32),
    "output": dict(num_warps=4, stages=(1,), BK=128, BV=64),
    "dv_local": dict(num_warps=8, stages=(3, 2, 1), BK=64, BV=128),
    # state_bwd: value tiles from 64 down to 16 as state_fwd's (chunk_fwd.state_tile); depth and
    # form by waves: the plain kernel, or QS (chunk_bwd.state_bwd_kernel: the row scale on Q, 4 KB
    # less shared memory for a [64, K] scaling per step). Never the plain kernel with one stage:
    # triton 3.6 miscompiles it on the H200 (wrong dh0, dk, dv at 10 of the GPU check's cases,
    # an illegal access at K = V = 256; docs/TRITON.md "Known problems")
    "state_bwd": dict(num_warps=4, waves=True, SV=8192, BV_min=16,
                      stages=(3, (3, {"QS": True}), 2, (2, {"QS": True}), (1, {"QS": True}))),
    # dqk, wy_bwd, dv_local: pipelined loops over their value / key blocks (H200, sixth session, GPU
    # µs at (4, 8192, 16, 128)): dqk 920 → 742 with two stages (→ 700 with three at 1 × 32768),
    # wy_bwd 599 → 569 with three, dv_local 170 → 158 with three
    "dqk": dict(num_warps=4, stages=(3, 2, 1), BK=64, BV=64),
    "wy_bwd": dict(num_warps=4, stages=(3, 2, 1), BK=64, BV=64),
    "cumsum": dict(num_warps=1, stages=(1,)),
    # The split state passes (chunk_fwd.split_len): L = 0 off, > 0 fixed segment length in chunks,
    # -1 automatic. Off: it passes the GPU check but is slower on the H200 (docs/TRITON.md).
    "split": dict(L=0, min_L=8),
    # the split passes' first phase (K + V columns per state; SV = K · columns of one program's tile)
    "state_aug": dict(num_warps=4, stages=(2, 1), SV=8192),
    "chain": dict(num_warps=4, stages=(1,), SV=4096, BC=32),
}


def update_config(partial: dict) -> None:
    """Apply ``{kernel: {key: value}}`` (e.g. parsed JSON) to :data:`CONFIG` in place; ``stages``
    lists become tuples (a [depth, form] entry a pair). For benchmarks and checks that try launch
    configurations."""
    for name, upd in partial.items():
        CONFIG[name].update({k: tuple(x if isinstance(x, int) else (x[0], x[1]) for x in v) if k == "stages" else v
                             for k, v in upd.items()})


def update_config_from(arg: str) -> None:
    """:func:`update_config` from a JSON file's path or an inline JSON text (benchmarks' --config)."""
    import json

    if os.path.exists(arg):
        with open(arg) as f:
            arg = f.read()
    update_config(json.loads(arg))


def pad_zeros(x: torch.Tensor | None, *pads: int) -> torch.Tensor | None:
    """``F.pad(x, pads)`` when any pad is non-zero, made contiguous; None stays None (the autograd
    wrappers zero-pad K and V to the kernels' sizes with it)."""
    if x is None:
        return None
    return (torch.nn.functional.pad(x, pads) if any(pads) else x).contiguous()


def kernel_dtype(*xs) -> torch.dtype:
    """The one dtype the kernels compute q, k, v in: the promotion of the inputs' dtypes when it is
    fp32, fp16 or bf16, else fp32 (fp64 inputs are computed in fp32)."""
    dt = xs[0].dtype
    for x in xs[1:]:
        dt = torch.promote_types(dt, x.dtype)
    return dt if dt in (torch.float32, torch.float16, torch.bfloat16) else torch.float32


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (4 off CUDA, e.g. under the interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tiles(name: str, K: int, V: int) -> tuple[int, int]:
    """(BK, BV) of kernel ``name``: its configured tiles capped at the next power of two of K, V;
    for the sequential passes the whole K and ``SV // BK`` values."""
    c = CONFIG[name]
    if "SV" in c:
        BK = pow2(K)
        return BK, min(pow2(V), max(16, c["SV"] // BK))
    return min(c["BK"], pow2(K)), min(c["BV"], pow2(V))


def pow2(n: int, lo: int = 16) -> int:
    """Smallest power of two ≥ max(n, lo) (tl.dot needs tiles of at least 16)."""
    return max(lo, 1 << (int(n) - 1).bit_length()) if n > 1 else lo


@triton.jit
def chunk_bounds(cu, chunk_idx, i_t, BT: tl.constexpr):
    """(sequence n, first token of chunk i_t, end of its sequence) as int64 token indices."""
    i_n = tl.load(chunk_idx + 2 * i_t)
    i_c = tl.load(chunk_idx + 2 * i_t + 1).to(tl.int64)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    return i_n, bos + i_c * BT, eos


@triton.jit
def gate_cumsum(g, rows, m, HV, i_hv):
    """In-chunk cumulative log decay γ [BT] (fp32) and its total γ_C (0 on padded rows)."""
    b_g = tl.load(g + rows * HV + i_hv, mask=m, other=0.0).to(tl.float32)
    return tl.cumsum(b_g, axis=0), tl.sum(b_g, axis=0)


@triton.jit
def gate_load(G, rows, m, HV, i_hv, last, valid):
    """γ [BT] of one chunk read from the precomputed in-chunk cumulative log decay G [T, HV], and
    γ_C = G at the chunk's last valid row ``last`` (0 when ``valid`` is false: a chunk outside its
    sequence). The sequential passes use this instead of :func:`gate_cumsum`, keeping the scan off
    their per-chunk critical path."""
    b_g = tl.load(G + rows * HV + i_hv, mask=m, other=0.0)
    b_c = tl.load(G + last * HV + i_hv, mask=valid, other=0.0)
    return b_g, b_c


@triton.jit
def gate_cumsum_kernel(g, G, cu, chunk_idx, HV, BT: tl.constexpr):
    """G[t, hv] = in-chunk cumulative sum of g (fp32), one program per chunk and value head."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_n, t0, eos = chunk_bounds(cu, chunk_idx, i_t, BT)
    rows = t0 + tl.arange(0, BT)
    m = rows < eos
    b_g, _ = gate_cumsum(g, rows, m, HV, i_hv)
    tl.store(G + rows * HV + i_hv, b_g, mask=m)


def chunk_cumsum(g: torch.Tensor, ch: "Chunks") -> torch.Tensor:
    """The in-chunk cumulative log decay of g [T, HV] (fp32), for the sequential passes."""
    G = torch.empty_like(g)
    launch(gate_cumsum_kernel, (ch.NT, g.shape[1]), g, G, ch.cu, ch.chunk_idx, g.shape[1], BT=BT, name="cumsum")
    return G


@triton.jit
def value_cols(o_v, m, K: tl.constexpr, V: tl.constexpr, AUG: tl.constexpr):
    """(value-column offsets, [BT, BV] mask) of a state tile's columns ``o_v``: o_v itself, or for
    the augmented tiles of the split passes ([K transition columns | V value columns]) o_v − K
    with the transition columns masked off (they read zeros)."""
    if AUG:
        o_u = o_v - K
        mv = m[:, None] & ((o_v >= K) & (o_u < V))[None, :]
    else:
        o_u = o_v
        mv = m[:, None] & (o_v < V)[None, :]
    return o_u, mv


_STAGES: dict = {}
_RECORD: list | None = None  # launches collected instead of run, inside recording()
log = logging.getLogger(__name__)


def launch(kernel, grid, *args, name: str, config: dict | None = None, **meta):
    """``kernel[grid](*args, **meta)`` with the warps of ``config[name]`` (default: this module's
    ``CONFIG``) and one of its candidates ``stages``: software-pipelining depths, each an int or a
    pair (depth, form), a form being compile-time switches of the kernel (e.g. one that needs less
    shared memory for more arithmetic).

    Which candidate: with ``waves`` set in the kernel's config (the sequential passes, whose grids
    are about one wave of programs, each walking a whole sequence), :func:`by_waves` picks; else
    the first whose shared memory fits the card (remembered per kernel and compile-time arguments,
    so the fallback costs one failed load at most). Inside :func:`recording` nothing runs (a
    ``waves`` launch records each of its candidates)."""
    cfg = (CONFIG if config is None else config)[name]
    cands, ckey = _candidates(cfg["stages"])
    meta["num_warps"] = cfg["num_warps"]
    key = (kernel, tuple(meta.items()), ckey)  # (callers pass their keywords in a fixed order)
    waves = cfg.get("waves", False) and len(cands) > 1 and not INTERPRET
    if _RECORD is not None:
        for ns, f in (cands if waves else [_STAGES.get(key, cands[0])]):
            _RECORD.append((kernel, grid, args, dict(meta, **f, num_stages=ns)))
        return None
    if waves:
        ns, f = by_waves(kernel, grid, args, meta, cands, key + (_device_index(),))
        return kernel[grid](*args, num_stages=ns, **dict(meta, **f))
    if key in _STAGES:
        ns, f = _STAGES[key]
        return kernel[grid](*args, num_stages=ns, **dict(meta, **f))
    for i, (ns, f) in enumerate(cands):
        try:
            out = kernel[grid](*args, num_stages=ns, **dict(meta, **f))
        except triton.runtime.errors.OutOfResources:
            if i == len(cands) - 1:
                raise
            continue
        _STAGES[key] = (ns, f)
        return out


def candidates(stages) -> list:
    """``stages`` (ints, or (depth, form) pairs) as a list of (depth, form dict) pairs."""
    return [(s, {}) if isinstance(s, int) else (int(s[0]), dict(s[1])) for s in stages]


_CANDS: dict = {}


def _candidates(stages) -> tuple:
    """(:func:`candidates` of ``stages``, a hashable key of them), made once per ``stages`` object
    (the entry holds the object, so its id is not reused): a launch costs no more host time."""
    hit = _CANDS.get(id(stages))
    if hit is None or hit[0] is not stages:
        c = candidates(stages)
        hit = _CANDS[id(stages)] = (stages, c, str(c))
    return hit[1], hit[2]


_FITS: dict = {}


def by_waves(kernel, grid, args, meta, cands, key) -> tuple:
    """Of ``cands`` [(pipeline depth, form)] (in the config's order: deepest first), the one whose
    compiled kernel runs ``grid`` in the fewest waves on the CUDA device ``key[-1]``, the first
    among equals. Each candidate is compiled once (``warmup``); its shared memory and registers
    give the programs one multiprocessor holds (:func:`per_sm`).

    Why: a sequential pass's program walks a whole sequence, one chunk step after another, so a
    second wave doubles the pass's time, while a deeper pipeline (the next chunks' tiles loaded
    during this chunk's products) shortens each step but takes shared memory. Measured on the H200
    (docs/TRITON.md "Waves"): where a third stage added a wave the pass got slower, where it kept
    the waves it got faster, in nine of ten cases; state_bwd's QS form at (4, 8192) runs two
    stages in one wave where the plain form needs two waves (446 against 568 µs), and is slower
    wherever it does not save a wave (1 × 32768: 948 against 714)."""
    fits, dev = _FITS.get(key), key[-1]
    if fits is None:
        fits = []
        for ns, f in cands:
            try:
                ck = kernel.warmup(*args, grid=grid, num_stages=ns, **dict(meta, **f))
                ck._init_handles()
            except triton.runtime.errors.OutOfResources:
                continue
            fits.append(((ns, f), per_sm(ck.metadata.shared, ck.n_regs, meta["num_warps"], _card(dev))))
        if not fits:
            raise triton.runtime.errors.OutOfResources(0, 0, f"shared memory of every candidate {cands}")
        _FITS[key] = fits
    return pick(fits, math.prod(grid), sm_count(torch.device("cuda", dev) if dev >= 0 else torch.device("cpu")))


def pick(fits, programs: int, sms: int):
    """From ``fits`` [(candidate, programs per multiprocessor)], the candidate with the fewest waves
    of ``programs`` on ``sms`` multiprocessors, the first among equals."""
    return min(enumerate(fits), key=lambda f: (-(-programs // (sms * max(f[1][1], 1))), f[0]))[1][0]


#: Per multiprocessor on Hopper (sm_90), used where the card does not say: shared memory (bytes),
#: 32-bit registers, resident threads
SM90 = dict(shared=228 * 1024, regs=65536, threads=2048)


def per_sm(shared: int, regs: int, warps: int, card: dict | None = None) -> int:
    """Programs one multiprocessor holds, by shared memory (1 KB of it reserved per program),
    registers (allocated per warp in units of 256) and threads. ``card``: :data:`SM90`'s keys
    (default: the current CUDA device's, else :data:`SM90`)."""
    c = card or _card(_device_index())
    warp_regs = -(-regs * 32 // 256) * 256
    return min(c["shared"] // (shared + 1024), c["regs"] // max(warp_regs * warps, 1), c["threads"] // (32 * warps))


def _device_index() -> int:
    """The current CUDA device's index, -1 without CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() else -1


@functools.lru_cache(maxsize=None)
def _card(index: int) -> dict:
    """Per-multiprocessor limits of CUDA device ``index`` (:data:`SM90` for -1 or without CUDA)."""
    if index < 0 or not torch.cuda.is_available():
        return SM90
    p = torch.cuda.get_device_properties(index)
    return dict(shared=getattr(p, "shared_memory_per_multiprocessor", SM90["shared"]),
                regs=getattr(p, "regs_per_multiprocessor", SM90["regs"]),
                threads=getattr(p, "max_threads_per_multi_processor", SM90["threads"]))


@contextmanager
def recording():
    """Inside this context :func:`launch` runs nothing and collects ``(kernel, grid, args, meta)``
    instead (buffers are still allocated by the launchers, never written)."""
    global _RECORD
    saved, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = saved


_WARM: set = set()


def precompile(key, dry_run) -> None:
    """Compile, in parallel threads, every kernel that ``dry_run()`` would launch, once per ``key``.

    A cold first call otherwise compiles the chunk kernels one after another (≈ 8 s for a
    forward + backward on the H200's host, each kernel 0.3–2 s of LLVM and ptxas); Triton's
    ``AsyncCompileMode`` takes ``warmup`` compiles on an executor. Nothing here is needed for
    correctness: on any failure the kernels compile at their launch as before."""
    if key in _WARM or INTERPRET:
        return
    _WARM.add(key)
    try:
        with recording() as launches:
            dry_run()
        workers = max(1, min(16, os.cpu_count() or 1, len(launches)))
        with ThreadPoolExecutor(workers) as ex, triton.AsyncCompileMode(ex):
            for kernel, grid, args, meta in launches:
                kernel.warmup(*args, grid=grid, **meta)
    except Exception as e:  # noqa: BLE001 - an optimisation only; the launches compile themselves
        log.warning("parallel precompile of the chunk kernels failed (%s: %s); compiling at launch",
                    type(e).__name__, e)
