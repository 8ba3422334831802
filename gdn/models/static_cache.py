"""Fixed-shape decoding: a preallocated cache, a decode step that writes into it, and its CUDA graphs.

:class:`StaticCache` holds one buffer set per layer whose shapes never change: the conv tails and
the fp32 (fp64 for fp64 models) matrix state of a recurrent mixer, ``max_length`` key/value slots
of a global attention layer, and a ring of ``window`` slots of a sliding-window layer. It is filled
from the :class:`gdn.models.GDNCache` of an ordinary chunked prefill (:meth:`StaticCache.load`).

:func:`static_decode_step` feeds one token per row and updates the buffers in place; the slot
count ``seen`` and the RoPE ``positions`` live on the device, so the step has no shape that depends
on the length, no host sync and no data-dependent branch: it can be captured in a CUDA graph.
:class:`GraphDecoder` captures it once per batch-size bucket (rows padded up to the bucket) and
replays it per token; on the CPU (or with ``use_graph=False``) it runs the very same step eagerly.
Rows of a running batch can take new sequences in place (:meth:`StaticCache.load_rows`,
:meth:`GraphDecoder.refill`, :meth:`GraphDecoder.release`), so one graph serves a stream of prompts.

The step computes each layer's projections of its input with one GEMM, on weights concatenated
once (:class:`DecodeWeights`, shared by a decoder's buckets), updates recurrent states in place,
and adds each residual in the kernel of the norm that reads the sum (a block hands its MLP output
to the next block's norm, the last to the final norm).
It equals the eager decode (:func:`gdn.generation.decode_step`) up to the blocking of those GEMMs
(every output is the same dot product); attention reads its keys from the fixed buffer under a
validity mask, which changes only the order of the softmax sums.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..layers import Attention
from ..layers.fused import refresh_all
from ..layers.state import KVState, RecurrentState
from .cache import GDNCache

#: Default batch-size buckets of :class:`GraphDecoder`: a batch runs in the smallest bucket that holds it.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _model_dtype(model) -> torch.dtype:
    return model.get_input_embeddings().weight.dtype


class DecodeWeights:
    """The decode step's fused projection weights of every block (``layers[i]``: block i's
    :meth:`gdn.models.GDNBlock.decode_weights`).

    They are copies of the model's weights, made once. :meth:`refresh` copies again, into the same
    storage (captured graphs read it by address), the ones whose source weights were written in
    place or moved since; :meth:`StaticCache.load` calls it, so each decode run starts from the
    model's current weights. A model whose weights change dtype or device needs new ones (its
    :class:`GraphDecoder` too)."""

    def __init__(self, model):
        self.layers = [block.decode_weights() for block in model.model.layers]

    def refresh(self) -> None:
        refresh_all(self.layers)


class StaticCache:
    """Preallocated per-layer decoding buffers for ``batch_size`` rows and up to ``max_length`` slots.

    ``layers[i]``: a :class:`RecurrentState` of buffers (conv tails [B, D, K-1], views of one buffer
    ``tails`` [B, ΣD, K-1]; matrix state [B, HV, K, V]) or a :class:`KVState` of buffers (key/value
    [B, L, HKV, D], valid [B, L] bool; L = ``max_length`` for global attention, ``window`` for a
    sliding window, used as a ring where slot s lives at s mod window). ``seen``: [] long, slots
    processed (device); ``positions``: [B] long, the RoPE position of each row's next token
    (device); ``length``: ``seen`` as a host int, kept by whoever drives the steps
    (:class:`GraphDecoder`) for bounds checks outside the step.
    ``weights``: the :class:`DecodeWeights` the step multiplies by (given, to share one set between
    caches, or made here).
    """

    def __init__(self, model, batch_size: int, max_length: int, device=None, weights: DecodeWeights | None = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        device = torch.device(device) if device is not None else model.get_input_embeddings().weight.device
        dtype = _model_dtype(model)
        sdtype = torch.float64 if dtype == torch.float64 else torch.float32
        B = batch_size
        self.batch_size, self.max_length, self.device = B, max_length, device
        self.layers: list[RecurrentState | KVState] = []
        for block in model.model.layers:
            m = block.mixer
            if isinstance(m, Attention):
                L = max_length if m.window_size is None else m.window_size
                kv = (B, L, m.num_kv_heads, m.head_dim)
                self.layers.append(KVState(torch.zeros(kv, dtype=dtype, device=device),
                                           torch.zeros(kv, dtype=dtype, device=device),
                                           torch.zeros(B, L, dtype=torch.bool, device=device), m.window_size, 0))
            else:
                shapes = m.state_shape(B)
                conv, tails = (), None
                if shapes["conv"]:  # one buffer, the q, k, v tails its channel slices (one convolution)
                    tails = torch.zeros(B, sum(s[1] for s in shapes["conv"]), shapes["conv"][0][2], dtype=dtype,
                                        device=device)
                    conv = tuple(tails.split([s[1] for s in shapes["conv"]], dim=1))
                self.layers.append(RecurrentState(conv, torch.zeros(shapes["recurrent"], dtype=sdtype, device=device),
                                                  tails))
        self.seen = torch.zeros((), dtype=torch.long, device=device)
        self.positions = torch.zeros(B, dtype=torch.long, device=device)
        self.length = 0
        self.weights = DecodeWeights(model) if weights is None else weights

    def buffers(self) -> list[torch.Tensor]:
        """Every state buffer (the step writes into these and allocates none)."""
        out = []
        for st in self.layers:
            out += [*st.conv, st.recurrent] if isinstance(st, RecurrentState) else [st.key, st.value, st.valid]
        return out + [self.seen, self.positions]

    def reset(self) -> None:
        """Empty every row (zero states, no valid key, position 0), in place."""
        for t in self.buffers():
            t.zero_()
        self.length = 0

    def load(self, cache: GDNCache) -> None:
        """Become a copy of ``cache`` (B ≤ ``batch_size`` rows; rows past B are left empty), in place.

        Its attention keys (left-padded rows included) go to their slots: slot s of a global layer
        at buffer index s, of a window layer at s mod window. ``cache.seen`` must be below
        ``max_length`` when the model has a global attention layer. The fused weights are refreshed
        from the model's (:meth:`DecodeWeights.refresh`)."""
        if not isinstance(cache, GDNCache):
            raise TypeError(f"cache must be a GDNCache, got {type(cache).__name__}")
        B = cache.batch_size
        if B > self.batch_size:
            raise ValueError(f"the cache holds {B} rows but this static cache only {self.batch_size}")
        seen = cache.seen
        if self._has_global() and seen >= self.max_length:
            raise ValueError(f"the cache holds {seen} slots; a global attention layer needs room for the next "
                             f"token within max_length={self.max_length}")
        self.reset()
        self.weights.refresh()
        self.seen.fill_(seen)
        self.length = seen
        self.load_rows(cache, range(B))  # from an empty cache whose slot counter is the prefill's

    def _rows(self, rows) -> torch.Tensor:
        idx = [int(r) for r in rows]
        if not idx or len(set(idx)) != len(idx) or any(not 0 <= r < self.batch_size for r in idx):
            raise ValueError(f"rows must be distinct rows in [0, {self.batch_size}), got {list(rows)}")
        return torch.tensor(idx, dtype=torch.long, device=self.device)

    @staticmethod
    def span(cache: GDNCache) -> int:
        """Slots a global attention layer of ``cache`` fills, from its first valid key to its last
        (left padding no row uses is not counted); 0 without global attention."""
        need = 0
        for st in cache.layers:
            if isinstance(st, KVState) and st.window is None and st.key.shape[1]:
                used = st.valid.any(0)
                if bool(used.any()):
                    need = max(need, st.key.shape[1] - int(used.long().argmax()))
        return need

    def load_rows(self, cache: GDNCache, rows: Sequence[int]) -> None:
        """Write the B' rows of ``cache`` (a prefill's :class:`GDNCache`) into rows ``rows`` of this
        static cache, in place; the other rows are not touched and no buffer is reallocated.

        The slot counter ``seen`` is shared by all rows and does not move, so the newcomers' keys are
        placed relative to it: each one's last key at slot ``seen - 1``, the one before at
        ``seen - 2`` and so on (a window layer's ring at those slots mod window), and every other slot
        of those rows is emptied. Recurrent states, conv tails and positions are copied. A global
        attention layer cannot place keys before slot 0: ``cache`` must fill at most ``seen`` slots
        (:meth:`span`), and the next token needs ``seen < max_length``; otherwise ``ValueError``
        (:meth:`shift` makes room first)."""
        if not isinstance(cache, GDNCache):
            raise TypeError(f"cache must be a GDNCache, got {type(cache).__name__}")
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"the cache has {len(cache.layers)} layers, this static cache {len(self.layers)}")
        idx = self._rows(rows)
        if cache.batch_size != idx.numel():
            raise ValueError(f"rows names {idx.numel()} rows but the cache holds {cache.batch_size}")
        seen = int(self.seen)
        self.length = seen
        if self._has_global():
            need = self.span(cache)
            if need > seen:
                raise ValueError(f"the cache fills {need} global attention slots but only {seen} lie before "
                                 f"the shared slot counter: shift({need - seen}) first")
            if seen >= self.max_length:
                raise ValueError(f"no room for the next token: {seen} of max_length={self.max_length} "
                                 f"global attention slots are used")
        self.clear_rows(idx.tolist())
        for buf, st in zip(self.layers, cache.layers):
            if st is None:
                continue
            if isinstance(buf, RecurrentState):
                if not isinstance(st, RecurrentState) or len(st.conv) != len(buf.conv):
                    raise ValueError("the cache's layer states do not match this model's mixers")
                for b, c in zip(buf.conv, st.conv):
                    b.index_copy_(0, idx, c.to(b.dtype))
                buf.recurrent.index_copy_(0, idx, st.recurrent.to(buf.recurrent.dtype))
                continue
            if not isinstance(st, KVState) or st.window != buf.window:
                raise ValueError("the cache's layer states do not match this model's mixers")
            Tc = st.key.shape[1]
            if buf.window is None:
                n = min(Tc, seen)  # columns before the last `seen` hold no valid key (checked above)
                slots = torch.arange(seen - n, seen, device=self.device)
            else:
                if Tc > buf.window:
                    raise ValueError(f"a window layer holds {Tc} keys, more than its window {buf.window}")
                n = Tc
                slots = torch.arange(seen - n, seen, device=self.device) % buf.window
            if n == 0:
                continue
            at = (idx[:, None], slots[None, :])
            buf.key[at] = st.key[:, Tc - n:].to(buf.key)
            buf.value[at] = st.value[:, Tc - n:].to(buf.value)
            buf.valid[at] = st.valid[:, Tc - n:].to(self.device)
        self.positions.index_copy_(0, idx, cache.positions.to(self.positions))

    def clear_rows(self, rows: Sequence[int]) -> None:
        """Empty rows ``rows`` (zero states, no valid key, position 0), in place; ``seen`` is kept."""
        idx = self._rows(rows)
        for t in self.buffers()[:-2]:
            t.index_fill_(0, idx, 0)
        self.positions.index_fill_(0, idx, 0)

    def shift(self, d: int) -> None:
        """Move every row's keys ``d`` slots later (``d > 0``: ``d`` empty slots open in front, as left
        padding would) or ``-d`` slots earlier (the first ``-d`` slots are discarded: the caller makes
        sure no row still needs them), and the slot counter ``seen`` with them, in place. Window rings
        rotate by ``d`` so that slot s stays at s mod window. Decoding afterwards gives what it gave
        before (attention reads only valid slots; RoPE positions are per row)."""
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"d must be an int, got {d!r}")
        seen = int(self.seen)
        if seen + d < 0:
            raise ValueError(f"cannot move the slots {-d} earlier: only {seen} are used")
        if d > 0 and self._has_global() and seen + d >= self.max_length:
            raise ValueError(f"moving the slots {d} later needs max_length > {seen + d}, this static cache has "
                             f"{self.max_length}")
        if d == 0:
            self.length = seen
            return
        for st in self.layers:
            if not isinstance(st, KVState):
                continue
            for t in (st.key, st.value, st.valid):
                if st.window is not None:
                    t.copy_(t.roll(d, 1))
                elif d > 0:
                    t[:, d:] = t[:, :-d].clone()
                    t[:, :d] = 0
                else:
                    t[:, :d] = t[:, -d:].clone()
                    t[:, d:] = 0
        self.seen.add_(d)
        self.length = seen + d

    def compact(self) -> int:
        """Drop the leading global attention slots that no row attends to (:meth:`shift` back by as
        many; the caller empties finished rows first); returns the number dropped (0 without global
        attention)."""
        seen = int(self.seen)
        self.length = seen
        lead = seen
        for st in self.layers:
            if isinstance(st, KVState) and st.window is None:
                used = st.valid[:, :seen].any(0)
                lead = min(lead, int(used.long().argmax()) if bool(used.any()) else seen)
        if not self._has_global() or lead == 0:
            return 0
        self.shift(-lead)
        return lead

    def _has_global(self) -> bool:
        return any(isinstance(st, KVState) and st.window is None for st in self.layers)

    def room(self) -> int | None:
        """Decode steps left before a global layer's buffer is full (None without global attention)."""
        return self.max_length - self.length if self._has_global() else None


def static_decode_step(model, cache: StaticCache, tokens: torch.Tensor) -> torch.Tensor:
    """Feed ``tokens`` [B] (one per row, B = ``cache.batch_size``) and return the next logits [B, vocab]
    (fp32), updating ``cache``'s buffers, ``seen`` and ``positions`` in place. Fixed shapes, no
    host sync: this is what :class:`GraphDecoder` captures. Does not touch ``cache.length``."""
    x, delta = model.get_input_embeddings()(tokens[:, None]), None
    for block, st, w in zip(model.model.layers, cache.layers, cache.weights.layers):
        slot = None
        if isinstance(st, KVState):
            slot = cache.seen if st.window is None else torch.remainder(cache.seen, st.window)
        x, delta = block.decode_into(x, st, slot, cache.positions, w, delta)
    x = model.model.norm(x) if delta is None else model.model.norm.add_forward(x, delta)[1]
    logits = model.lm_head(x)[:, -1].float()
    cache.seen.add_(1)
    cache.positions.add_(1)
    return logits


@dataclass
class _Bucket:
    cache: StaticCache
    tokens: torch.Tensor
    logits: torch.Tensor | None = None
    graph: object | None = None


class GraphDecoder:
    """Decode steps on a :class:`StaticCache`, captured as CUDA graphs per batch-size bucket.

    Args:
        model: a :class:`gdn.models.GDNForCausalLM` in eval mode.
        max_length: slots (prompt + generated) a global attention layer can hold.
        buckets: batch sizes to capture; a batch of B rows runs in the smallest bucket ≥ B, padded
            with empty rows (token 0) that never reach the real rows.
        use_graph: capture and replay CUDA graphs (default: when the model is on a CUDA device);
            otherwise the same step runs eagerly.

    Use: ``start(cache)`` with the :class:`GDNCache` of a prefill, then ``step(tokens [B])`` ->
    logits [B, vocab] per token. A bucket's graph is captured the first time it is used (after a
    warm-up on a side stream, on an emptied cache) and kept for later ``start`` calls.
    :meth:`reserve` prepares a bucket ahead, with its own length (a bucket's buffers are sized once).
    """

    def __init__(self, model, max_length: int, buckets: Sequence[int] = BUCKETS, use_graph: bool | None = None):
        self.model, self.max_length = model, max_length
        self.buckets = sorted({int(b) for b in buckets})
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {list(buckets)}")
        self.device = model.get_input_embeddings().weight.device
        self.use_graph = self.device.type == "cuda" if use_graph is None else bool(use_graph)
        if self.use_graph and self.device.type != "cuda":
            raise ValueError("use_graph needs the model on a CUDA device")
        self.weights = DecodeWeights(model)
        self._buckets: dict[int, _Bucket] = {}
        self._active: _Bucket | None = None
        self.rows = 0
        self.free: set[int] = set()  # rows of the active batch that hold no sequence (release)

    def bucket(self, batch_size: int) -> int:
        """The bucket a batch of ``batch_size`` rows runs in."""
        for b in self.buckets:
            if b >= batch_size:
                return b
        raise ValueError(f"batch size {batch_size} is larger than the largest bucket {self.buckets[-1]}")

    def add_bucket(self, batch_size: int) -> None:
        """Let batches of up to ``batch_size`` rows run (a bucket of that size, captured on first use);
        nothing changes when a bucket already holds them."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if batch_size > self.buckets[-1]:
            self.buckets.append(batch_size)

    def reserve(self, batch_size: int, max_length: int | None = None) -> None:
        """Make ready a bucket for ``batch_size`` rows (adding one when the batch is above the largest)
        whose global attention layers hold ``max_length`` slots (default: this decoder's): a bucket
        built for fewer is rebuilt, and its graph captured again; one that holds more is kept."""
        length = self.max_length if max_length is None else max_length
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        self.add_bucket(batch_size)
        size = self.bucket(batch_size)
        b = self._buckets.get(size)
        if b is not None and (not b.cache._has_global() or b.cache.max_length >= length):
            return
        if b is not None:
            del self._buckets[size]
            if self._active is b:
                self._active, self.rows = None, 0
            del b  # its buffers and graph go before the new ones are allocated
        self._get(size, length)

    def _get(self, size: int, max_length: int | None = None) -> _Bucket:
        b = self._buckets.get(size)
        if b is None:
            length = self.max_length if max_length is None else max_length
            b = _Bucket(StaticCache(self.model, size, length, self.device, self.weights),
                        torch.zeros(size, dtype=torch.long, device=self.device))
            if self.use_graph:
                self._capture(b)
            self._buckets[size] = b
        return b

    @torch.no_grad()
    def _capture(self, b: _Bucket) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):  # first calls compile kernels and set up workspaces outside the graph
                b.cache.reset()
                static_decode_step(self.model, b.cache, b.tokens)
        torch.cuda.current_stream(self.device).wait_stream(side)
        b.cache.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            b.logits = static_decode_step(self.model, b.cache, b.tokens)
        b.graph = graph
        b.cache.reset()  # the capture does not run the kernels, but keep the contract: empty until load

    @torch.no_grad()
    def start(self, cache: GDNCache) -> None:
        """Decode from ``cache`` (a prefill's :class:`GDNCache`; copied, not kept) from now on."""
        b = self._get(self.bucket(cache.batch_size))
        b.cache.load(cache)
        self._active, self.rows = b, cache.batch_size
        self.free: set[int] = set()

    @torch.no_grad()
    def refill(self, cache: GDNCache, rows: Sequence[int]) -> None:
        """Put the sequences of ``cache`` (a prefill's :class:`GDNCache`, one row per name in ``rows``)
        into rows ``rows`` of the active batch, replacing what they held; the batch size, the bucket and
        its captured graph stay. When a global attention layer of ``cache`` fills more slots than the
        batch has used, every row's slots first move later by the difference (:meth:`StaticCache.shift`:
        the same keys, left-padded), which needs ``max_length`` above the newcomers' prompt length.
        Slots that only the replaced or released rows attended to are dropped first
        (:meth:`StaticCache.compact`), so ``seen`` stays at the longest live sequence."""
        static = self.static_cache
        self._check_rows(rows)
        named = {int(r) for r in rows}
        self.free |= named  # what they held is no longer needed: its slots may go first
        self._compact()
        need = static.span(cache)
        if need > int(static.seen):
            static.shift(need - int(static.seen))
        static.load_rows(cache, rows)
        self.free -= named

    @torch.no_grad()
    def release(self, rows: Sequence[int]) -> None:
        """The sequences of rows ``rows`` ended and nothing replaces them: the rows are emptied and stay
        in the batch (``step`` still takes a token for them, whose logits mean nothing) until
        :meth:`refill` or :meth:`start`. Keeping them keeps the captured graph; global attention slots
        only they held are dropped."""
        self._check_rows(rows)
        self.free |= {int(r) for r in rows}
        self.static_cache.clear_rows(rows)
        self._compact()

    def _check_rows(self, rows: Sequence[int]) -> None:
        if self._active is None:
            raise RuntimeError("call start(cache) first")
        idx = [int(r) for r in rows]
        if not idx or len(set(idx)) != len(idx) or any(not 0 <= r < self.rows for r in idx):
            raise ValueError(f"rows must be distinct rows of the active batch [0, {self.rows}), got {list(rows)}")

    def _compact(self) -> None:
        """Empty the rows no sequence uses (released rows and the bucket's padding rows, which keep
        writing keys as they are fed) and drop the global attention slots no live row attends to, so
        ``seen`` stays at the longest live row and ``max_length`` bounds one sequence, not a run."""
        static = self.static_cache
        if not static._has_global():
            return
        idle = sorted(self.free) + list(range(self.rows, static.batch_size))
        if idle:
            static.clear_rows(idle)
        static.compact()

    @property
    def static_cache(self) -> StaticCache:
        """The static cache the current rows decode on."""
        if self._active is None:
            raise RuntimeError("call start(cache) first")
        return self._active.cache

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (``tokens`` [B]) and return the next logits [B, vocab] (fp32)."""
        b = self._active
        if b is None:
            raise RuntimeError("call start(cache) first")
        if tokens.dim() != 1 or tokens.shape[0] != self.rows:
            raise ValueError(f"tokens must have shape [B] = [{self.rows}], got {list(tokens.shape)}")
        room = b.cache.room()
        if room is not None and room < 1:
            raise ValueError(f"the static cache is full: max_length={self.max_length} slots")
        b.tokens[: self.rows].copy_(tokens)
        b.tokens[self.rows:].zero_()
        if b.graph is not None:
            b.graph.replay()
            logits = b.logits[: self.rows].clone()
        else:
            logits = static_decode_step(self.model, b.cache, b.tokens)[: self.rows]
        b.cache.length += 1
        return logits
