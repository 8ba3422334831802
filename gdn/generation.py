"""Generation without ``model.generate()``: prefill the prompt in one chunked pass, then decode
token by token on the recurrent path (constant-size state for the linear mixers, KV cache for
attention), streaming tokens as they come.

    for tokens in stream(model, input_ids, max_new_tokens=64, top_p=0.9):
        ...  # tokens: [B] the next token of every sequence

``generate(...)`` collects the stream (with an optional per-step callback).

Several prompts that share token prefixes: :func:`prefill_shared` prefills every shared prefix once
and forks its cache; :func:`stream_shared` / :func:`generate_shared` then decode all prompts as one
batch. :func:`prefill_snapshots` gives copies of the cache at chosen offsets of a prompt (prefix
caches to reuse later, e.g. with :meth:`gdn.models.GDNCache.restore` or ``fork``).

Prompts of different lengths without padding: :func:`prefill_packed` prefills them as one packed row
and gives a cache with a row per prompt; :func:`stream_slots` / :func:`generate_slots` decode many
prompts through a fixed number of slots, refilling a slot with the next prompt when its sequence ends
(on the eager cache, or on a graph decoder's static cache with ``graph=``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence

import torch

from .layers.attention import Attention
from .layers.state import KVState, RecurrentState
from .models import GDNCache, GraphDecoder, output_cache

logger = logging.getLogger(__name__)


def _model_step(model, input_ids, attention_mask, cache):
    out = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                logits_to_keep=1, return_dict=True)
    return out.logits[:, -1].float(), output_cache(out)


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            cache: GDNCache | None = None) -> tuple[torch.Tensor, GDNCache]:
    """Run the prompt in one chunked forward pass.

    Args:
        model: a :class:`gdn.models.GDNForCausalLM`.
        input_ids: [B, T] prompt (left-padded when lengths differ).
        attention_mask: [B, T] (1 token, 0 padding) or None.
        cache: continue an existing cache (then ``attention_mask`` covers only the new tokens).
    Returns:
        ``(logits [B, vocab] fp32 of the last position, cache)``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [B, T] tensor, got {getattr(input_ids, 'shape', input_ids)}")
    return _model_step(model, input_ids, attention_mask, cache)


@torch.no_grad()
def prefill_snapshots(model, input_ids: torch.Tensor, snapshot_at: Sequence[int],
                      attention_mask: torch.Tensor | None = None,
                      cache: GDNCache | None = None) -> tuple[torch.Tensor, GDNCache, list[GDNCache]]:
    """Run the prompt in segments split at ``snapshot_at`` and keep a copy of the cache at each split.

    Each segment continues from the previous one's cache, so the copy at offset o holds the states
    (conv tails, recurrent states, attention keys and values) after ``input_ids[:, :o]``, the same as
    prefilling that prefix alone: exactly so for the first offset (it is that very call), within the
    chunked form's tolerance for the later ones (a chunked pass from a state equals the recurrence).

    Args:
        model, input_ids, attention_mask, cache: as in :func:`prefill` (offsets count columns of
            ``input_ids``, i.e. slots after what ``cache`` already holds).
        snapshot_at: strictly increasing offsets in [1, T].
    Returns:
        ``(logits [B, vocab] of the last position, cache, [a GDNCache copy per offset])``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [B, T] tensor, got {getattr(input_ids, 'shape', input_ids)}")
    T = input_ids.shape[1]
    offsets = [int(o) for o in snapshot_at]
    if not offsets or any(not 0 < o <= T for o in offsets) or any(b <= a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"snapshot_at must be strictly increasing offsets in [1, {T}], got {list(snapshot_at)}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask must have the shape of input_ids {list(input_ids.shape)}, "
                         f"got {list(attention_mask.shape)}")
    snapshots, lo, logits = [], 0, None
    for hi in offsets + ([T] if offsets[-1] < T else []):
        mask = None if attention_mask is None else attention_mask[:, lo:hi]
        logits, cache = _model_step(model, input_ids[:, lo:hi], mask, cache)
        if hi in offsets:
            snapshots.append(cache.snapshot())
        lo = hi
    return logits, cache, snapshots


def _common_prefix(seqs: list[Sequence[int]], start: int) -> int:
    """Length of the longest prefix all ``seqs`` share (they are known to share ``seqs[0][:start]``)."""
    n = min(len(s) for s in seqs)
    first = seqs[0]
    while start < n and all(s[start] == first[start] for s in seqs[1:]):
        start += 1
    return start


@torch.no_grad()
def prefill_shared(model, prompts: Sequence[Sequence[int]], *,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, GDNCache, int]:
    """Prefill several prompts (lists of token ids, any lengths), computing every shared prefix once.

    The prompts form a prefix tree: the longest prefix common to a group of prompts is prefilled once
    (one sequence), its cache is forked to each branch, and each branch continues with its own tokens
    (recursively, so a prefix shared by a subgroup is also computed once). Equal to prefilling each
    prompt alone within the chunked form's tolerance (greedy decoding gives the same tokens).

    Returns ``(logits [N, vocab] fp32 of every prompt's last token, one GDNCache with a row per prompt
    in the order given, the number of tokens prefilled)``; the cache's rows hold different lengths
    (attention keys left-padded), ready for :func:`decode_step`.
    """
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    device = device if device is not None else next(model.parameters()).device
    results: list = [None] * len(prompts)
    computed = 0

    def visit(group: list[int], depth: int, logits, cache):
        nonlocal computed
        lcp = _common_prefix([prompts[i] for i in group], depth)
        if lcp > depth:
            ids = torch.tensor([prompts[group[0]][depth:lcp]], device=device)
            logits, cache = _model_step(model, ids, None, cache)
            computed += lcp - depth
        branches: dict[int, list[int]] = {}
        ended = False
        for i in group:
            if len(prompts[i]) == lcp:
                results[i], ended = (logits, cache), True
            else:
                branches.setdefault(prompts[i][lcp], []).append(i)
        shared = ended or len(branches) > 1  # a branch continues a copy when others keep this cache
        for sub in branches.values():
            visit(sub, lcp, logits, cache.snapshot() if shared and cache is not None else cache)

    visit(list(range(len(prompts))), 0, None, None)
    logger.info("prefilled %d of %d prompt tokens (%d prompts, shared prefixes once)", computed,
                sum(map(len, prompts)), len(prompts))
    logits = torch.cat([r[0] for r in results])
    return logits, GDNCache.cat([r[1] for r in results]), computed


def _as_prompts(prompts) -> list[list[int]]:
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    return prompts


def _packed_kv(mixer: Attention, x: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> KVState:
    """An attention layer's cache rows for packed sequences: the keys (after norm and RoPE) and values
    of each sequence cut out of the packed row ``x`` [1, T, D] (the layer's input) and left-padded to
    one length; a sliding-window layer keeps each sequence's last ``window - 1``."""
    _, k, v = mixer.project(x, positions, queries=False)
    k, v = k[0], v[0]
    W = mixer.window_size
    kept = [n if W is None else min(n, W - 1) for n in lengths]
    slots = max(kept)
    N = len(lengths)
    key, value = k.new_zeros(N, slots, *k.shape[1:]), v.new_zeros(N, slots, *v.shape[1:])
    valid = torch.zeros(N, slots, dtype=torch.bool, device=x.device)
    end = 0
    for i, (n, m) in enumerate(zip(lengths, kept)):
        end += n
        key[i, slots - m:], value[i, slots - m:] = k[end - m:end], v[end - m:end]
        valid[i, slots - m:] = True
    return KVState(key, value, valid, W, max(lengths))


@torch.no_grad()
def prefill_packed(model, prompts: Sequence[Sequence[int]], *,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, GDNCache]:
    """Prefill several prompts (token lists of any lengths) as one packed row (``cu_seqlens``), no padding.

    One forward pass of the model over the concatenated prompts; each starts from zero state and RoPE
    position 0. The cache gets one row per prompt, as if each had been prefilled alone: the recurrent
    layers' final states and conv tails come per sequence from the ops (``cu_seqlens``), the attention
    layers' keys and values are cut out of the packed row per sequence (a sliding window's last
    ``window - 1``) and left-padded to a common length with masked slots.

    Returns ``(logits [N, vocab] fp32 of every prompt's last token, cache)``, ready for :func:`decode_step`.
    """
    prompts = _as_prompts(prompts)
    device = device if device is not None else next(model.parameters()).device
    lengths = [len(p) for p in prompts]
    ids = torch.tensor([[t for p in prompts for t in p]], device=device)
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    base = model.model
    states: dict[int, object] = {}
    hooks = []

    def ask_state(module, args, kwargs):  # recurrent mixers return their per-sequence states
        return args, {**kwargs, "use_cache": True}

    def keep_state(i):
        def hook(module, args, kwargs, out):
            if isinstance(module, Attention):
                states[i] = _packed_kv(module, args[0] if args else kwargs["x"], kwargs["positions"], lengths)
            else:
                states[i] = out[1]
        return hook

    try:
        for i, block in enumerate(base.layers):
            if not isinstance(block.mixer, Attention):
                hooks.append(block.mixer.register_forward_pre_hook(ask_state, with_kwargs=True))
            hooks.append(block.mixer.register_forward_hook(keep_state(i), with_kwargs=True))
        with _eval(model):
            out = model(input_ids=ids, cu_seqlens=cu, use_cache=False, logits_to_keep=cu[1:].long() - 1,
                        return_dict=True)
    finally:
        for h in hooks:
            h.remove()
    cache = GDNCache.for_config(model.config, len(prompts), device=device)
    for i in range(len(cache.layers)):
        s = states[i]
        if not isinstance(s, (RecurrentState, KVState)):
            raise RuntimeError(f"layer {i} gave no state for the packed prefill")
        cache.layers[i] = s
    cache.positions = torch.tensor(lengths, dtype=torch.long, device=device)
    cache.seen = max(lengths)
    cache._reset_history()
    return out.logits[0].float(), cache


@torch.no_grad()
def decode_step(model, tokens: torch.Tensor, cache: GDNCache) -> torch.Tensor:
    """Feed one token per sequence (``tokens`` [B]) and return the next logits [B, vocab] (fp32);
    ``cache`` is advanced in place."""
    if tokens.dim() != 1 or tokens.shape[0] != cache.batch_size:
        raise ValueError(f"tokens must have shape [B] = [{cache.batch_size}], got {list(tokens.shape)}")
    logits, _ = _model_step(model, tokens[:, None], None, cache)
    return logits


def sample_next(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Choose the next token from ``logits`` [B, vocab]: greedy when ``temperature == 0``, else sample
    from softmax(logits / temperature) restricted to the ``top_k`` best and to the smallest set
    whose probability reaches ``top_p``. Returns [B] long."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or a positive int, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
    if temperature == 0:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def stream(model, input_ids: torch.Tensor, *, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
           temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           eos_token_id: int | None = None, pad_token_id: int = 0,
           generator: torch.Generator | None = None,
           graph: bool | GraphDecoder = False) -> Iterator[torch.Tensor]:
    """Yield the next token of every sequence ([B] long), up to ``max_new_tokens`` times.

    Prefill (one chunked pass over ``input_ids`` [B, T], left-padded with ``attention_mask``), then
    one recurrent decode step per token. A sequence that produced ``eos_token_id`` continues with
    ``pad_token_id``; the stream ends when all have finished. Sampling as in :func:`sample_next`.
    ``graph``: decode on a fixed-shape :class:`gdn.models.StaticCache` filled from the prefill,
    through a :class:`gdn.models.GraphDecoder` (True: a new one sized for this call; or one to
    reuse, whose captured graphs are kept), replayed as CUDA graphs on a GPU and run eagerly on the CPU.
    """
    _check_max_new(max_new_tokens)
    if max_new_tokens == 0:
        return
    with _eval(model):
        logits, cache = prefill(model, input_ids, attention_mask)
        yield from _decode(model, logits, cache, max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id, generator=generator,
                           graph=graph)


@torch.no_grad()
def stream_shared(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                  top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
                  pad_token_id: int = 0, generator: torch.Generator | None = None,
                  graph: bool | GraphDecoder = False) -> Iterator[torch.Tensor]:
    """:func:`stream` for several prompts (token lists of any lengths) that may share prefixes:
    :func:`prefill_shared` computes each shared prefix once, then all prompts decode as one batch.
    Yields [N] tokens per step, row i for ``prompts[i]``; greedy, row i equals streaming
    ``prompts[i]`` alone. ``graph`` as in :func:`stream`."""
    _check_max_new(max_new_tokens)
    if max_new_tokens == 0:
        return
    with _eval(model):
        logits, cache, _ = prefill_shared(model, prompts)
        yield from _decode(model, logits, cache, max_new_tokens, temperature=temperature, top_k=top_k,
                           top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id, generator=generator,
                           graph=graph)


def _check_max_new(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")


@contextlib.contextmanager
def _eval(model):
    """The model in eval mode inside, its training flag restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _decode(model, logits, cache, max_new_tokens, *, temperature, top_k, top_p, eos_token_id, pad_token_id,
            generator, graph=False) -> Iterator[torch.Tensor]:
    """The decode loop after a prefill: sample from ``logits`` [B, vocab], yield, feed back (on the
    ``GDNCache``, or on a static cache through a :class:`GraphDecoder` when ``graph`` is one or True)."""
    step_fn = functools.partial(decode_step, model, cache=cache)
    if graph is True:
        graph = GraphDecoder(model, max_length=cache.seen + max_new_tokens)
    if isinstance(graph, GraphDecoder):
        graph.start(cache)
        step_fn = graph.step
    elif graph is not False and graph is not None:
        raise TypeError(f"graph must be a bool or a GraphDecoder, got {type(graph).__name__}")
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    for step in range(max_new_tokens):
        tok = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        tok = tok.masked_fill(done, pad_token_id)
        yield tok
        if eos_token_id is not None:
            done |= tok == eos_token_id
            if bool(done.all()):
                return
        if step + 1 < max_new_tokens:
            logits = step_fn(tok)


def generate(model, input_ids: torch.Tensor, *, max_new_tokens: int,
             callback: Callable[[int, torch.Tensor], None] | None = None, **kwargs) -> torch.Tensor:
    """Prompt plus generated tokens, [B, T + n] (n ≤ ``max_new_tokens``; fewer when every sequence
    ended with ``eos_token_id``). ``callback(step, tokens [B])`` is called for every new token;
    other keyword arguments as in :func:`stream`."""
    new = []
    for step, tok in enumerate(stream(model, input_ids, max_new_tokens=max_new_tokens, **kwargs)):
        new.append(tok)
        if callback is not None:
            callback(step, tok)
    logger.debug("generated %d tokens for %d sequences", len(new), input_ids.shape[0])
    if not new:
        return input_ids
    return torch.cat([input_ids, torch.stack(new, 1).to(input_ids.dtype)], 1)


@torch.no_grad()
def stream_slots(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int], batch_size: int,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | None = None, pad_token_id: int = 0,
                 generator: torch.Generator | None = None,
                 graph: bool | GraphDecoder = False) -> Iterator[tuple[int, list[int]]]:
    """Generate for many prompts through at most ``batch_size`` decoding slots, refilled as sequences finish.

    The first ``batch_size`` prompts are prefilled packed (:func:`prefill_packed`) and decode as one
    batch. When a sequence ends (``eos_token_id`` or its ``max_new_tokens``, an int or one per prompt)
    its slot takes the next waiting prompt: the newcomers of a step are prefilled packed and their
    rows written into the free slots (:meth:`GDNCache.restore`), so the batch stays full while
    prompts wait; when none wait, finished rows are dropped. Yields ``(prompt index, new tokens)`` as
    each prompt finishes (a list ending with ``eos_token_id`` when one came). Greedy, every prompt gets
    the tokens it gets alone. Sampling as in :func:`sample_next`.

    ``graph``: decode on a :class:`gdn.models.GraphDecoder` (True: a new one; or one to reuse) whose
    batch keeps its size: newcomers go into the free rows in place (:meth:`GraphDecoder.refill`) and
    finished rows with no newcomer stay, emptied and fed ``pad_token_id`` (:meth:`GraphDecoder.release`),
    so one captured graph serves the whole run. Its global attention layers get
    ``max(len(prompt) + max_new_tokens)`` slots, enough for any one sequence.
    """
    prompts = _as_prompts(prompts)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"max_new_tokens gives {len(limits)} limits for {len(prompts)} prompts")
    for n in limits:
        _check_max_new(n)
    if graph is not False and graph is not True and not isinstance(graph, GraphDecoder):
        raise TypeError(f"graph must be a bool or a GraphDecoder, got {type(graph).__name__}")
    waiting = [i for i in range(len(prompts)) if limits[i] > 0]
    for i in range(len(prompts)):
        if limits[i] == 0:
            yield i, []
    if not waiting:
        return
    with _eval(model):
        rows: list[int | None] = waiting[:batch_size]     # prompt index of every row (None: free)
        waiting = waiting[batch_size:]
        logits, cache = prefill_packed(model, [prompts[i] for i in rows])
        dec = None
        if graph is not False:
            # Global attention: compaction keeps the used slots at the longest live sequence's.
            length = max(len(prompts[i]) + limits[i] for i in rows + waiting)
            dec = GraphDecoder(model, max_length=length) if graph is True else graph
            dec.reserve(len(rows), length)
            dec.start(cache)
        out: dict[int, list[int]] = {i: [] for i in rows}
        while True:
            live = [r for r, i in enumerate(rows) if i is not None]
            if len(live) == len(rows):
                tok = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            else:                                         # free rows of a graph batch: sample the live ones
                at = torch.tensor(live, device=logits.device)
                tok = torch.full((len(rows),), pad_token_id, dtype=torch.long, device=logits.device).index_copy(
                    0, at, sample_next(logits.index_select(0, at), temperature=temperature, top_k=top_k,
                                       top_p=top_p, generator=generator))
            free = []
            values = tok.tolist()
            for r in live:
                i, t = rows[r], values[r]
                out[i].append(t)
                if len(out[i]) >= limits[i] or (eos_token_id is not None and t == eos_token_id):
                    yield i, out.pop(i)
                    free.append(r)
            if not waiting and len(free) == len(live):
                return
            if not waiting and free:                      # nothing to refill: drop the finished rows
                if dec is not None:
                    dec.release(free)
                    for r in free:
                        rows[r] = None
                else:
                    keep = [r for r in range(len(rows)) if r not in free]
                    idx = torch.tensor(keep, device=tok.device)
                    cache.index_select(idx)
                    tok, rows = tok.index_select(0, idx), [rows[r] for r in keep]
                free = []
            idle = free + [r for r in range(len(rows)) if rows[r] is None]
            feed = tok.masked_fill(_row_mask(idle, tok), pad_token_id)
            logits = decode_step(model, feed, cache) if dec is None else dec.step(feed)
            if free:
                new, waiting = waiting[:len(free)], waiting[len(free):]
                slots = free[:len(new)]
                new_logits, new_cache = prefill_packed(model, [prompts[i] for i in new])
                if dec is None:
                    cache.restore(new_cache, slots)
                else:
                    dec.refill(new_cache, slots)
                at = torch.tensor(slots, device=logits.device)
                logits = logits.index_copy(0, at, new_logits.to(logits.dtype))
                for r, i in zip(slots, new):
                    rows[r] = i
                    out[i] = []
                gone = free[len(new):]                    # prompts ran out: drop the rest
                if gone and dec is not None:
                    dec.release(gone)
                    for r in gone:
                        rows[r] = None
                elif gone:
                    keep = [r for r in range(len(rows)) if r not in gone]
                    idx = torch.tensor(keep, device=logits.device)
                    cache.index_select(idx)
                    logits, rows = logits.index_select(0, idx), [rows[r] for r in keep]
                if dec is None:
                    cache.compact()


def _row_mask(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros_like(like, dtype=torch.bool)
    if rows:
        mask[rows] = True
    return mask


def generate_slots(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
                   batch_size: int, callback: Callable[[int, list[int]], None] | None = None,
                   **kwargs) -> list[list[int]]:
    """The new tokens of every prompt, in input order, generated by :func:`stream_slots` (at most
    ``batch_size`` sequences at a time, slots refilled as sequences finish). ``callback(index,
    tokens)`` is called as each prompt finishes; other keyword arguments as in :func:`stream_slots`."""
    outs: list[list[int] | None] = [None] * len(prompts)
    for i, new in stream_slots(model, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, **kwargs):
        outs[i] = new
        if callback is not None:
            callback(i, new)
    return outs


def generate_shared(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    callback: Callable[[int, torch.Tensor], None] | None = None, **kwargs) -> list[list[int]]:
    """The new tokens of every prompt (lists of ids; each list ends after its ``eos_token_id`` when
    one came), generated by :func:`stream_shared` (shared prefixes computed once). ``callback(step,
    tokens [N])`` is called for every step; other keyword arguments as in :func:`stream`."""
    eos = kwargs.get("eos_token_id")
    out: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(out)
    for step, tok in enumerate(stream_shared(model, prompts, max_new_tokens=max_new_tokens, **kwargs)):
        if callback is not None:
            callback(step, tok)
        for i, t in enumerate(tok.tolist()):
            if not finished[i]:
                out[i].append(t)
                finished[i] = eos is not None and t == eos
    return out
