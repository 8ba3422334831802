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
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"the cache has {len(cache.layers)} layers, this static cache {len(self.layers)}")
        B = cache.batch_size
        if B > self.batch_size:
            raise ValueError(f"the cache holds {B} rows but this static cache only {self.batch_size}")
        seen = cache.seen
        if self._has_global() and seen >= self.max_length:
            raise ValueError(f"the cache holds {seen} slots; a global attention layer needs room for the next "
                             f"token within max_length={self.max_length}")
        self.reset()
        self.weights.refresh()
        for buf, st in zip(self.layers, cache.layers):
            if st is None:
                continue
            if isinstance(buf, RecurrentState):
                if not isinstance(st, RecurrentState) or len(st.conv) != len(buf.conv):
                    raise ValueError("the cache's layer states do not match this model's mixers")
                for b, c in zip(buf.conv, st.conv):
                    b[:B].copy_(c)
                buf.recurrent[:B].copy_(st.recurrent)
            else:
                if not isinstance(st, KVState) or st.window != buf.window:
                    raise ValueError("the cache's layer states do not match this model's mixers")
                Tc = st.key.shape[1]
                if Tc == 0:
                    continue
                slots = torch.arange(seen - Tc, seen, device=self.device)
                if buf.window is not None:
                    if Tc > buf.window:
                        raise ValueError(f"a window layer holds {Tc} keys, more than its window {buf.window}")
                    slots = slots % buf.window
                buf.key[:B].index_copy_(1, slots, st.key.to(buf.key))
                buf.value[:B].index_copy_(1, slots, st.value.to(buf.value))
                buf.valid[:B].index_copy_(1, slots, st.valid.to(self.device))
        self.seen.fill_(seen)
        self.positions[:B].copy_(cache.positions)
        self.length = seen

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
