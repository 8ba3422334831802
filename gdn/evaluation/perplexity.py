"""Loss, perplexity and bits per byte of a causal LM on packed held-out rows."""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..ops import offsets


@dataclass
class EvalResult:
    """Mean loss (nats/token) over ``tokens`` predicted tokens standing for ``bytes`` UTF-8 bytes."""

    loss: float
    tokens: int
    bytes: int
    nats: float

    @property
    def perplexity(self) -> float:
        """exp(loss)."""
        return math.exp(min(self.loss, 700.0))

    @property
    def bits_per_byte(self) -> float:
        """Total bits / bytes."""
        return self.nats / math.log(2) / max(self.bytes, 1)


@torch.no_grad()
def score_packed(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, bytes_per_token: torch.Tensor,
                 autocast=None) -> tuple[float, int, int]:
    """``(nats, tokens, bytes)`` summed over the next-token predictions of one packed row.

    input_ids: [1, L]; cu_seqlens: [N + 1] (no prediction across a boundary); bytes_per_token: [vocab]."""
    with autocast or nullcontext():
        logits = model(input_ids=input_ids, cu_seqlens=cu_seqlens, use_cache=False).logits
    target = F.pad(input_ids[:, 1:], (0, 1), value=-100)
    ends = cu_seqlens.long()[1:] - 1
    target[:, ends] = -100
    target = target.reshape(-1)
    nats = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target, ignore_index=-100, reduction="sum")
    valid = target >= 0
    nbytes = bytes_per_token.to(target.device)[target[valid]].sum()
    return float(nats), int(valid.sum()), int(nbytes)


def evaluate(model, batches, bytes_per_token, device=None, autocast=None) -> EvalResult:
    """:class:`EvalResult` over ``batches`` (``(input_ids [1, L], cu_seqlens)`` pairs)."""
    device = device or next(model.parameters()).device
    bpt = torch.as_tensor(np.asarray(bytes_per_token), dtype=torch.long, device=device)
    was = model.training
    model.eval()
    nats = tokens = nbytes = 0
    try:
        for ids, cu in batches:
            n, t, b = score_packed(model, ids.to(device), offsets.to_device(cu, device), bpt, autocast)
            nats, tokens, nbytes = nats + n, tokens + t, nbytes + b
    finally:
        model.train(was)
    return EvalResult(nats / max(tokens, 1), tokens, nbytes, nats)


def evaluate_checkpoint(path, data: str | None = None, seq_len: int | None = None, batches: int = 16,
                        batch_size: int = 8, device: str | None = None) -> tuple[EvalResult, float]:
    """``(result, unigram baseline bits per byte)`` of a checkpoint on the held-out split of ``data``
    (default: the data, tokenizer, split and window length it was trained with)."""
    import yaml

    from ..checkpoint import load_model
    from ..data import eval_batches, load_corpus, unigram_bits_per_byte

    model, tok, path = load_model(path, device)
    run = yaml.safe_load((path / "train_config.yaml").read_text()) if (path / "train_config.yaml").exists() else {}
    data = data if data is not None else run.get("data")
    seq_len = seq_len or run.get("seq_len", 512)
    train, val = load_corpus(data, tok, val_fraction=run.get("val_fraction", 0.02),
                             text_field=run.get("text_field", "text"), bin_dtype=run.get("bin_dtype", "uint16"),
                             eos_id=run.get("eos_id"))
    rows = eval_batches(val, seq_len, batches, batch_size)
    dev = next(model.parameters()).device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else None
    return evaluate(model, rows, val.bytes_per_token, dev, autocast), unigram_bits_per_byte(train, val, tok.vocab_size)
