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
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence

import torch

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
