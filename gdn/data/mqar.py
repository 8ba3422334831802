"""Multi-query associative recall (MQAR), as defined by Zoology (Arora et al., 2023).

A sequence starts with ``num_pairs`` key-value pairs ``k1 v1 k2 v2 ...`` (keys drawn without
replacement from ids ``1 .. vocab/2 - 1``, values from ``vocab/2 .. vocab - 1``); every key is
then asked again once, the queries sitting at even offsets of the remaining positions with gaps
drawn from a power law ``p(gap) ∝ (gap + 1) ** (alpha - 1)`` (short gaps likely, long ones
possible). Other positions hold random tokens. The model must predict, at each query position,
the value that was paired with the key; accuracy counts query positions only.
"""
from __future__ import annotations

import numpy as np
import torch


def mqar_batch(num_examples: int, seq_len: int, num_pairs: int, vocab_size: int, *, alpha: float = 0.01,
               seed: int = 0, random_fill: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs [N, T] long, targets [N, T] long)``: ``targets[n, t]`` is the value the model must
    output at query position ``t`` (the id that should come next), ``-100`` elsewhere.

    Needs ``seq_len >= 4 * num_pairs`` (room for the pairs and the spread-out queries) and
    ``vocab_size // 2 > num_pairs`` (distinct keys)."""
    for name, val in (("num_examples", num_examples), ("seq_len", seq_len), ("num_pairs", num_pairs),
                      ("vocab_size", vocab_size)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    half = vocab_size // 2
    if half - 1 < num_pairs:
        raise ValueError(f"vocab_size ({vocab_size}) must give more than num_pairs ({num_pairs}) keys: "
                         f"need vocab_size >= {2 * (num_pairs + 1)}")
    ctx = 2 * num_pairs
    space = (seq_len - ctx) // 2
    if space < num_pairs:
        raise ValueError(f"seq_len ({seq_len}) too short for {num_pairs} pairs and their queries: "
                         f"need seq_len >= {4 * num_pairs}")
    rng = np.random.default_rng(seed)
    keys = np.argsort(rng.random((num_examples, half - 1)), axis=1)[:, :num_pairs] + 1
    values = np.argsort(rng.random((num_examples, vocab_size - half)), axis=1)[:, :num_pairs] + half
    p = np.arange(1, space + 1, dtype=np.float64) ** (alpha - 1)
    p /= p.sum()
    gaps = np.stack([rng.choice(space, size=num_pairs, replace=False, p=p) for _ in range(num_examples)])
    inputs = np.zeros((num_examples, seq_len), dtype=np.int64)
    inputs[:, 0:ctx:2], inputs[:, 1:ctx:2] = keys, values
    qpos = ctx + 2 * gaps  # position of each query key
    rows = np.arange(num_examples)[:, None]
    inputs[rows, qpos] = keys
    targets = np.full((num_examples, seq_len), -100, dtype=np.int64)
    targets[rows, qpos] = values
    if random_fill:
        filler = rng.integers(0, vocab_size, size=inputs.shape)
        free = np.ones_like(inputs, dtype=bool)
        free[:, :ctx] = False
        free[rows, qpos] = False
        inputs[free] = filler[free]
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def mqar_mixture(num_examples: int, seq_len: int, pairs: list[int], vocab_size: int, *, alpha: float = 0.01,
                 seed: int = 0, random_fill: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs [N, T], targets [N, T])`` as :func:`mqar_batch`, but the ``N`` sequences hold
    different numbers of key-value pairs: an equal share for every entry of ``pairs`` (the first
    ``N % len(pairs)`` entries one more), in a random order fixed by ``seed``. Zoology trains on
    such a mixture; the easy sequences teach the lookup early, the hard ones its capacity.
    Every entry must fit ``seq_len`` and ``vocab_size`` as in :func:`mqar_batch`."""
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ValueError(f"pairs must be a non-empty list of ints, got {pairs!r}")
    if not isinstance(num_examples, int) or isinstance(num_examples, bool) or num_examples < len(pairs):
        raise ValueError(f"num_examples must be an int >= len(pairs) ({len(pairs)}), got {num_examples!r}")
    share, extra = divmod(num_examples, len(pairs))
    parts = []
    for i, p in enumerate(pairs):
        sub_seed = int(np.random.SeedSequence([seed, i, p]).generate_state(1)[0])
        parts.append(mqar_batch(share + (i < extra), seq_len, p, vocab_size, alpha=alpha, seed=sub_seed,
                                random_fill=random_fill))
    order = torch.from_numpy(np.random.default_rng(seed).permutation(num_examples))
    return torch.cat([x for x, _ in parts])[order], torch.cat([y for _, y in parts])[order]
