"""Generation without ``model.generate()``: prefill the prompt in one chunked pass, then decode
token by token on the recurrent path (constant-size state for the linear mixers, KV cache for
attention), streaming tokens as they come.

    for tokens in stream(model, input_ids, max_new_tokens=64, top_p=0.9):
        ...  # tokens: [B] the next token of every sequence

``generate(...)`` collects the stream (with an optional per-step callback).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from .models import GDNCache, output_cache

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
           generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token of every sequence ([B] long), up to ``max_new_tokens`` times.

    Prefill (one chunked pass over ``input_ids`` [B, T], left-padded with ``attention_mask``), then
    one recurrent decode step per token. A sequence that produced ``eos_token_id`` continues with
    ``pad_token_id``; the stream ends when all have finished. Sampling as in :func:`sample_next`.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if max_new_tokens == 0:
        return
    was_training = model.training
    model.eval()
    try:
        logits, cache = prefill(model, input_ids, attention_mask)
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            tok = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            tok = tok.masked_fill(done, pad_token_id)
            yield tok
            if eos_token_id is not None:
                done |= tok == eos_token_id
                if bool(done.all()):
                    return
            if step + 1 < max_new_tokens:
                logits = decode_step(model, tok, cache)
    finally:
        model.train(was_training)


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
