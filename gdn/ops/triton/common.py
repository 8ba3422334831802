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
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from .. import offsets
from ..tuning import BT, INTERPRET, cdiv, chunk_tiles, pow2  # noqa: F401  (re-exported to the kernels)
from .launch import direct, has_tma, launch, sm_count  # noqa: F401  (re-exported to the kernels)


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
    # what is derived from the layout once and reused by every later call on it (segments by L)
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def long_sequences(self) -> int:
        """Sequences of at least 90 % of the longest one's chunks: those whose programs are still
        running at the end of a sequential pass (all N of a dense batch; in a packed batch often
        one). Counted once per layout (a dense layout is reused across calls)."""
        per = self.host_per
        return self.N if per is None else int((per * 10 >= self.max_nc * 9).sum())

    @functools.cached_property
    def empty_sequences(self) -> np.ndarray:
        """Indices of the sequences without a token (host int64)."""
        per = self.host_per
        return np.zeros(0, dtype=np.int64) if per is None else np.flatnonzero(per.numpy() == 0)


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
    seq: torch.Tensor  # [NS] the sequence of each segment


def to_device_many(arrays, device: torch.device) -> list[torch.Tensor]:
    """int32 copies of the host integer arrays on ``device`` in one transfer (one pinned buffer on
    CUDA, copied asynchronously: no host sync), as views of one device buffer. Each view starts on a
    16-byte boundary, so Triton sees the same pointer alignment whatever the sizes."""
    sizes = [len(a) for a in arrays]
    starts = np.cumsum([0] + [-(-n // 4) * 4 for n in sizes])
    buf = np.zeros(int(starts[-1]), dtype=np.int32)
    for a, s0, n in zip(arrays, starts, sizes):
        buf[s0:s0 + n] = np.asarray(a).reshape(-1)
    t = torch.from_numpy(buf)
    if device.type == "cuda":
        t = t.pin_memory()
        if torch.cuda.is_current_stream_capturing():
            # a captured copy reads this host buffer again at every replay of the graph: it is kept
            # for the process, so that no later pinned allocation reuses (and overwrites) it
            _CAPTURED_HOST.append(t)
    t = t.to(device, non_blocking=True)
    return [t[s0:s0 + n] for s0, n in zip(starts, sizes)]


_CAPTURED_HOST: list[torch.Tensor] = []  # the pinned sources of copies captured in CUDA graphs


def fill_empty(out, src, ch: Chunks) -> None:
    """``out[n] = src[n]`` (0 without ``src``) for the empty sequences n of ``ch``, for the passes that
    have no program, or no step, for them (a warm-started split pass has no segment for them; the
    KDA state pass stores the final state in its last chunk's step): their final state is h0, their
    dS₀ is dht."""
    empty = ch.empty_sequences
    if out is not None and len(empty):
        empty, = to_device_many([empty], out.device)  # (no host sync; a CUDA graph may capture it)
        out[empty] = src[empty] if src is not None else 0.0


def make_segments(ch: "Chunks", L: int, device: torch.device) -> Segments:
    """Cut every sequence of ``ch`` into segments of ``L`` chunks (built on the host in numpy, no
    sync; made once per layout, L and device, and kept in ``ch.memo``: the layers of a model and
    the backward reuse it)."""
    return _memo(ch, ("segments", L, device), lambda: _segments(ch, L, device))


def _memo(ch: "Chunks", key, build):
    """``ch.memo[key]``, built by ``build()`` on first use (:func:`offsets.lasting`: it outlives
    the call)."""
    if key not in ch.memo:
        ch.memo[key] = offsets.lasting(build)
    return ch.memo[key]


def _segment_layout(ch: "Chunks", L: int) -> tuple:
    """(count, first, seq, c0, bos, ends) of the segments of ``L`` chunks on the host (int64): each
    sequence's segment count and first segment; each segment's sequence, first chunk in it, first
    token and end."""
    per, cu = ch.host_per.numpy().astype(np.int64), ch.host_cu.numpy().astype(np.int64)
    count = (per + L - 1) // L
    first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    seq = np.repeat(np.arange(len(count)), count)
    c0 = (np.arange(len(seq)) - first[seq]) * L
    bos = cu[:-1][seq] + c0 * BT
    # a sequence's last segment ends at its own end, which is the next segment's start (or the total)
    ends = np.minimum(bos + L * BT, cu[1:][seq])
    return count, first, seq, c0, bos, ends


def _segments(ch: "Chunks", L: int, device: torch.device) -> Segments:
    count, first, seq, c0, bos, ends = _segment_layout(ch, L)
    NS = len(seq)
    cu = ch.host_cu.numpy().astype(np.int64)
    off = np.concatenate([[0], np.cumsum(ch.host_per.numpy().astype(np.int64))[:-1]])[seq] + c0
    seg_cu = np.concatenate([bos, ends[-1:]]) if NS else cu[-1:]
    assert NS == 0 or bool((seg_cu[1:-1] == ends[:-1]).all()), "segments must tile the token stream"
    d_cu, d_off, d_first, d_count, d_seq = to_device_many([seg_cu, off, first, count, seq], device)
    return Segments(d_cu, d_off, d_first, d_count, NS, L, int(count.max()) if NS else 0, d_seq)


@dataclass(frozen=True)
class Slice:
    """Chunk positions [a, b) of every sequence or segment (one slice of :func:`make_slices` or
    :func:`make_tail_slices`), as the reverse pass and the per-chunk backward kernels take them.
    Tensors on the compute device (int32)."""

    starts: torch.Tensor  # [N] first token of each run's part (where it would start if empty)
    ends: torch.Tensor  # [N] end of each run's part (= its start if empty)
    off: torch.Tensor  # [N] the dh row of each run's part's first chunk (its others follow it)
    chunk_idx: torch.Tensor  # [NT, 2] (sequence, chunk in sequence) of the slice's chunks
    NT: int
    rows: torch.Tensor  # [NT, 2] each of the slice's chunks' state row in h and dS_out row in dh


def make_slices(ch: "Chunks", L: int, device: torch.device) -> list[Slice]:
    """Cut the chunk positions of every sequence of ``ch`` into slices of ``L`` (slice j: chunks
    [jL, (j + 1)L) of each sequence, empty for the shorter ones), last slice first: the order in which
    the reverse pass runs them. Built on the host in numpy (no sync), once per layout, L and device."""
    return _memo(ch, ("slices", L, device), lambda: _slices(ch, L, device))


def _slices(ch: "Chunks", L: int, device: torch.device) -> list[Slice]:
    per, cu = ch.host_per.numpy().astype(np.int64), ch.host_cu.numpy().astype(np.int64)
    parts = [(np.minimum(j * L, per), np.minimum((j + 1) * L, per)) for j in reversed(range(cdiv(ch.max_nc, L)))]
    return _cut(cu[:-1], cu[1:], np.arange(len(per)), np.zeros_like(per), parts, device, _run_first(per, 0))


def _cut(bos, end, seq, c0, parts, device: torch.device, h_first, bases=None) -> list[Slice]:
    """The :class:`Slice` of each of ``parts`` [(a, b)]: chunks [a, b) of every run of tokens
    [bos, end) (a sequence, or a segment of sequence ``seq`` from its chunk ``c0`` on). A chunk's
    state row in h: ``h_first`` [its run] + its index in the run; each part's dS_out rows: from
    ``bases`` [the runs' first rows, one array a part] where given, else its own rows 0, 1, … in run
    order (a buffer of the slice's size)."""
    out, arrays = [], []
    for j, (a, b) in enumerate(parts):
        cnt = b - a
        ends = np.minimum(bos + b * BT, end)
        starts = np.minimum(bos + a * BT, ends)
        first = np.concatenate([[0], np.cumsum(cnt)[:-1]]).astype(np.int64)
        owner = np.repeat(np.arange(len(bos)), cnt)
        place = np.arange(int(cnt.sum())) - first[owner]
        idx = np.stack([seq[owner], c0[owner] + a[owner] + place], axis=1)
        off = first if bases is None else np.asarray(bases[j], dtype=np.int64)
        rows = np.stack([h_first[owner] + a[owner] + place, off[owner] + place], axis=1)
        arrays += [starts, ends, off, idx.reshape(-1), rows.reshape(-1)]
        out.append(int(cnt.sum()))
    d = to_device_many(arrays, device)
    return [Slice(d[5 * i], d[5 * i + 1], d[5 * i + 2], d[5 * i + 3].view(nt, 2), nt, d[5 * i + 4].view(nt, 2))
            for i, nt in enumerate(out)]


def tail_sizes(max_nc: int, first: int) -> list[int]:
    """The chunk counts of :func:`make_tail_slices`' slices: ``first`` (the most a sequence's dS_out
    may take beyond its states), then each as many as the rows its predecessors and the first leave
    free (the k-th at most the first plus all before it), until ``max_nc`` are covered."""
    sizes = [min(max(1, first), max_nc)]
    while sum(sizes) < max_nc:
        sizes.append(min(max_nc - sum(sizes), sizes[0] + sum(sizes)))
    return sizes


def _runs(ch: "Chunks", L: int) -> tuple:
    """(bos, ends, seq, c0, chunks) of the runs of tokens the state passes take one program each
    (host int64): the sequences (``L`` 0) or their segments of ``L`` chunks (:func:`make_segments`)."""
    per, cu = ch.host_per.numpy().astype(np.int64), ch.host_cu.numpy().astype(np.int64)
    if not L:
        return cu[:-1], cu[1:], np.arange(len(per)), np.zeros_like(per), per
    _, _, seq, c0, bos, ends = _segment_layout(ch, L)
    return bos, ends, seq, c0, np.minimum(per[seq] - c0, L)


def make_tail_slices(ch: "Chunks", sizes: tuple[int, ...], device: torch.device, L: int = 0,
                     shared: bool = True) -> list[Slice]:
    """The chunks of every sequence (or with ``L`` of every segment of L chunks, :func:`make_segments`)
    cut from its end into slices of ``sizes`` chunks (slice j: its chunks [n − S_j − s_j, n − S_j)
    of n, S_j = s_0 + … + s_{j−1}, empty where it has no more), tails first: the order in which the
    sliced reverse pass runs them (the warm-started split's first slice warms every segment up from
    its end, the later ones go on from the dS carried out of the slice before). A slice's starts,
    ends and off are per run; its chunk_idx names the real (sequence, chunk in sequence).
    ``shared`` (sizes from :func:`tail_sizes`): the dS_out rows lie in the state buffer laid out by
    :func:`state_rows` (pad s_0 after each of the same runs), slice j's rows of a run from the row
    after its own chunks' states, over the states of the chunks after them (used by the slices
    before) and the run's pad; where the reverse pass and the per-chunk stage run slice by slice,
    those rows are free when the slice's reverse pass writes them. Else each slice's dS_out fill a
    buffer of its own, in the slice's order. Built on the host in numpy (no sync), once per layout,
    sizes, L, form and device."""
    key = ("tail slices", tuple(sizes), L, shared, device)
    return _memo(ch, key, lambda: _tail_slices(ch, tuple(sizes), device, L, shared))


def _tail_slices(ch: "Chunks", sizes: tuple[int, ...], device: torch.device, L: int, shared: bool) -> list[Slice]:
    bos, ends, seq, c0, n = _runs(ch, L)
    first = _run_first(n, sizes[0] if shared else 0)
    S = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    parts = [(np.maximum(n - S[j + 1], 0), np.maximum(n - S[j], 0)) for j in range(len(sizes))]
    return _cut(bos, ends, seq, c0, parts, device, first, [first + b for _, b in parts] if shared else None)


def _run_first(n: np.ndarray, pad: int) -> np.ndarray:
    """Each run's first state row when each of its ``n`` chunks' states is followed by min(pad, n)
    free rows."""
    rows = n + np.minimum(pad, n)
    return np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)


def state_rows(ch: "Chunks", pad: int, device: torch.device, L: int = 0, pad_L: int = 0) -> tuple[torch.Tensor, int]:
    """(the first state row of each program's run, the rows in all) of a per-chunk state buffer in
    which min(``pad``, its chunks) free rows follow the states of every sequence (``pad_L`` 0) or
    of every segment of ``pad_L`` chunks (:func:`make_tail_slices`' dS_out rows), for a pass whose
    programs take the sequences (``L`` 0) or the segments of ``L`` chunks: either where the pads lie
    between sequences, only the segments the pads follow where they lie between segments (ValueError
    otherwise: a program's states would straddle a pad). ``pad`` 0: ``chunk_off`` (or the segments'
    ``off``) and NT. Once per layout, pad, L, pad_L and device."""
    if not pad:
        return (make_segments(ch, L, device).off if L else ch.chunk_off), ch.NT
    if pad_L and L != pad_L:
        raise ValueError(f"state rows padded after segments of {pad_L} chunks are not those of runs of {L}")

    def build():
        n = _runs(ch, pad_L)[4]
        first = _run_first(n, pad)
        if L and not pad_L:  # segments within each padded sequence
            _, _, seq, c0, _, _ = _segment_layout(ch, L)
            first = first[seq] + c0
        return to_device_many([first], device)[0], int((n + np.minimum(pad, n)).sum())

    return _memo(ch, ("state rows", pad, L, pad_L, device), build)


def chunk_rows(ch: "Chunks", device: torch.device) -> torch.Tensor:
    """[NT, 2] (state row, dS_out row) of every chunk of an unsliced backward: both its own index."""
    return _memo(ch, ("chunk rows", device),
                 lambda: to_device_many([np.repeat(np.arange(ch.NT), 2)], device)[0].view(ch.NT, 2))


@functools.lru_cache(maxsize=64)
def _dense_chunks(B: int, T: int, device: torch.device) -> Chunks:
    """The chunk layout of B rows of T tokens, built once per (B, T, device): a call at a shape seen
    before launches no index kernels (the tensors are read-only to every kernel)."""
    return offsets.lasting(lambda: _dense_layout(B, T, device))


def _dense_layout(B: int, T: int, device: torch.device) -> Chunks:
    n_per = cdiv(T, BT)
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
    # every layer of a packed forward asks for the same layout: made once per offsets tensor
    return offsets.memo(cu_seqlens, ("chunks", device), lambda: _packed_chunks(cu_seqlens, device))


def _packed_chunks(cu_seqlens: torch.Tensor, device: torch.device) -> Chunks:
    # host-side index arithmetic in numpy: single-threaded and fast (torch's CPU ops on a dozen
    # elements took milliseconds on a loaded many-core host, e.g. repeat_interleave)
    host = offsets.host(cu_seqlens)
    h = host.numpy()
    per = (np.diff(h) + BT - 1) // BT
    N = len(per)
    off = np.zeros(N, dtype=np.int64)
    if N > 1:
        off[1:] = np.cumsum(per)[:-1]
    NT = int(per.sum())
    seq = np.repeat(np.arange(N), per)
    idx = np.stack([seq, np.arange(NT) - off[seq]], axis=1)
    d_cu, d_idx, d_off = to_device_many([h, idx.reshape(-1), off], device)
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



def pad_zeros(x: torch.Tensor | None, *pads: int) -> torch.Tensor | None:
    """``F.pad(x, pads)`` when any pad is non-zero, made contiguous; None stays None (the autograd
    wrappers zero-pad K and V to the kernels' sizes with it)."""
    if x is None:
        return None
    return (torch.nn.functional.pad(x, pads) if any(pads) else x).contiguous()


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, with ``x`` itself where it has that dtype already (the no-op call still costs
    the host a few µs, and the chunk op's wrappers make a dozen of them a call)."""
    return x if x.dtype == dtype else x.to(dtype)


def kernel_dtype(*xs) -> torch.dtype:
    """The one dtype the kernels compute q, k, v in: the promotion of the inputs' dtypes when it is
    fp32, fp16 or bf16, else fp32 (fp64 inputs are computed in fp32)."""
    dt = xs[0].dtype
    for x in xs[1:]:
        dt = torch.promote_types(dt, x.dtype)
    return dt if dt in (torch.float32, torch.float16, torch.bfloat16) else torch.float32


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


@triton.jit
def inv_unit_lower16(A, INV: tl.constexpr):
    """(I + A)⁻¹ for a strictly lower-triangular 16×16 fp32 block A (the in-chunk solve of both
    families), by the finite power series
    Σ_{j<16} (−A)ʲ = (I − A)(I + A²)(I + A⁴)(I + A⁸) (A is nilpotent: A¹⁶ = 0): six fp32 dots, no
    serial loop (a row-by-row substitution costs 15 dependent cross-warp reductions). The terms
    stay small for the bounded entries here (|A_ij| ≤ β|k_i·k_j| ≤ 1 with unit keys); for the
    worst case, every key equal and β = 1, the largest power entry is C(15, 7) = 6435, i.e. ≈ 13 of
    fp32's 24 bits, far below bf16 rounding of T and within the fp32 tolerance (tested). ``INV``:
    the dots' input precision ("ieee" exact fp32; "tf32"/"tf32x3" tensor-core passes)."""
    o = tl.arange(0, 16)
    M = -A
    X = (o[:, None] == o[None, :]).to(tl.float32) + M
    for _ in range(3):
        M = tl.dot(M, M, input_precision=INV)
        X = X + tl.dot(X, M, input_precision=INV)
    return X


@triton.jit
def load16(X_, rows, m, HV, i_hv, col0):
    """Rows ``rows`` of a [T, HV, 64] buffer, columns col0 … col0 + 15, as a fp32 16×16 block (0 off
    the sequence)."""
    o = tl.arange(0, 16)
    return tl.load(X_ + (rows[:, None] * HV + i_hv) * 64 + col0 + o[None, :], mask=m[:, None], other=0.0).to(
        tl.float32)


@triton.jit
def store16(X_, X, rows, m, HV, i_hv, col0):
    """Rows ``rows`` of a [T, HV, 64] buffer, columns col0 … col0 + 15, from the 16×16 block X."""
    o = tl.arange(0, 16)
    tl.store(X_ + (rows[:, None] * HV + i_hv) * 64 + col0 + o[None, :], X.to(X_.dtype.element_ty), mask=m[:, None])


@triton.jit
def inv_row1(A10, A11, X00, INV: tl.constexpr):
    """Row block 1 of T = (I + A)⁻¹ (strictly lower-triangular 64 × 64 A in 16 × 16 blocks, the
    in-chunk solve of both families): X11 = (I + A11)⁻¹ and X10 = −X11 A10 X00."""
    X11 = inv_unit_lower16(A11, INV)
    X10 = -tl.dot(X11, tl.dot(A10, X00, input_precision=INV), input_precision=INV)
    return X10, X11


@triton.jit
def inv_row2(A20, A21, A22, X00, X10, X11, INV: tl.constexpr):
    """Row block 2 of T: block forward substitution, X_2J = −X22 Σ_{J ≤ l < 2} A_2l X_lJ."""
    X22 = inv_unit_lower16(A22, INV)
    X21 = -tl.dot(X22, tl.dot(A21, X11, input_precision=INV), input_precision=INV)
    X20 = -tl.dot(X22, tl.dot(A20, X00, input_precision=INV) + tl.dot(A21, X10, input_precision=INV),
                  input_precision=INV)
    return X20, X21, X22


@triton.jit
def inv_row3(A30, A31, A32, A33, X00, X10, X11, X20, X21, X22, INV: tl.constexpr):
    """Row block 3 of T: X_3J = −X33 Σ_{J ≤ l < 3} A_3l X_lJ."""
    X33 = inv_unit_lower16(A33, INV)
    X32 = -tl.dot(X33, tl.dot(A32, X22, input_precision=INV), input_precision=INV)
    X31 = -tl.dot(X33, tl.dot(A31, X11, input_precision=INV) + tl.dot(A32, X21, input_precision=INV),
                  input_precision=INV)
    X30 = -tl.dot(X33, tl.dot(A30, X00, input_precision=INV) + tl.dot(A31, X10, input_precision=INV)
                  + tl.dot(A32, X20, input_precision=INV), input_precision=INV)
    return X30, X31, X32, X33


@triton.jit
def solve_blocks(A00, A10, A11, A20, A21, A22, A30, A31, A32, A33, INV: tl.constexpr):
    """The blocks X_IJ (J ≤ I) of T = (I + A)⁻¹ from all of A's blocks at once: the diagonal ones
    by :func:`inv_unit_lower16`, the rest by block forward substitution (:func:`inv_row1` …)."""
    X00 = inv_unit_lower16(A00, INV)
    X10, X11 = inv_row1(A10, A11, X00, INV)
    X20, X21, X22 = inv_row2(A20, A21, A22, X00, X10, X11, INV)
    X30, X31, X32, X33 = inv_row3(A30, A31, A32, A33, X00, X10, X11, X20, X21, X22, INV)
    return X00, X10, X11, X20, X21, X22, X30, X31, X32, X33


@triton.jit
def store_row(X_, X0, X1, X2, X3, rows, m, HV, i_hv):
    """One row block (rows ``rows``, mask m) of a [T, HV, 64] buffer from its four 16 × 16 blocks."""
    store16(X_, X0, rows, m, HV, i_hv, 0)
    store16(X_, X1, rows, m, HV, i_hv, 16)
    store16(X_, X2, rows, m, HV, i_hv, 32)
    store16(X_, X3, rows, m, HV, i_hv, 48)


@triton.jit
def store_blocks(X_, X00, X10, X11, X20, X21, X22, X30, X31, X32, X33, r0, r1, r2, r3, m0, m1, m2, m3, HV, i_hv):
    """One chunk's rows of a [T, HV, 64] buffer from the blocks of a lower-triangular 64 × 64
    matrix (rows r0 … r3 of the four row blocks, masks m0 … m3); the blocks above the diagonal
    are written as zeros."""
    z = tl.zeros([16, 16], dtype=tl.float32)
    store_row(X_, X00, z, z, z, r0, m0, HV, i_hv)
    store_row(X_, X10, X11, z, z, r1, m1, HV, i_hv)
    store_row(X_, X20, X21, X22, z, r2, m2, HV, i_hv)
    store_row(X_, X30, X31, X32, X33, r3, m3, HV, i_hv)


@triton.jit
def tl_sum(x, axis: tl.constexpr):
    """``tl.sum`` spelled as ``tl.reduce`` with the standard sum combiner. ``tl.sum`` itself is a
    jit function decorated when triton is first imported: in a test run where something imported
    triton before ``TRITON_INTERPRET=1`` was set, an interpreted kernel cannot call it, while this
    module's functions follow the setting at the time it is imported (and the interpreter
    recognises the standard combiner and sums in numpy)."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit(do_not_specialize=["R"])  # rows = tokens · heads: a new length compiles nothing
def group_sum_kernel(x, y, R, G: tl.constexpr, D: tl.constexpr, DO: tl.constexpr, BR: tl.constexpr,
                     BD: tl.constexpr):
    """y[r, :DO] = Σ_j x[r, j, :DO] for rows r of one block: fp32 sums, one rounding to y's dtype."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r < R)[:, None] & (o_d < DO)[None, :]
    rows = o_r.to(tl.int64)[:, None]
    acc = tl.zeros([BR, BD], dtype=tl.float32)
    for j in range(0, G):
        acc += tl.load(x + (rows * G + j) * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(y + rows * DO + o_d[None, :], acc.to(y.dtype.element_ty), mask=m)


def group_sum(x: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``x[..., G, D]`` (contiguous) summed over G, its first ``width`` columns, in ``dtype``:
    ``x[..., :width].sum(-2).to(dtype)`` in one pass (the per-value-head dq and dk of grouped
    heads: torch's sum and cast read and write the fp32 sums twice more). With G = 1 nothing is
    summed: a view of x, cast only if ``dtype`` differs."""
    *lead, G, D = x.shape
    if G == 1:
        return cast(x.view(*lead, D) if width == D else x[..., 0, :width], dtype)
    R = x.numel() // (G * D)
    y = torch.empty(*lead, width, device=x.device, dtype=dtype)
    BD = pow2(width)
    BR = max(1, min(64, 4096 // BD))
    direct(group_sum_kernel, (cdiv(R, BR),), x, y, R, G=G, D=D, DO=width, BR=BR, BD=BD, num_warps=4)
    return y
