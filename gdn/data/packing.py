"""Fixed-length windows of a token stream, packed with ``cu_seqlens`` at document boundaries.

A training sample is a window of ``seq_len`` consecutive tokens; the windows of an epoch are
visited in a permutation fixed by ``(seed, epoch)``, so the data position is one integer (samples
consumed) and any rank can compute any sample. A batch of windows becomes one packed row
``[1, M * seq_len]`` whose ``cu_seqlens`` cut at every window and every document start inside a
window: no token attends to, or carries state from, another document.
"""
from __future__ import annotations

import numpy as np
import torch

from .corpus import TokenCorpus


class PackedWindows:
    """Windows of ``seq_len`` tokens of ``corpus``, shuffled per epoch.

    Args:
        corpus: the :class:`TokenCorpus`.
        seq_len: tokens per window (T).
        seed: fixes every epoch's order.
        shuffle: False keeps stream order (evaluation).
    """

    def __init__(self, corpus: TokenCorpus, seq_len: int, seed: int = 0, shuffle: bool = True):
        if not isinstance(seq_len, int) or seq_len < 2:
            raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
        self.corpus, self.seq_len, self.seed, self.shuffle = corpus, seq_len, seed, shuffle
        self.num_windows = len(corpus) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"{corpus.name}: {len(corpus)} tokens are fewer than seq_len = {seq_len}")
        self._perm_epoch, self._perm = None, None

    def window_start(self, sample: int) -> int:
        """Stream offset of global sample number ``sample`` (epoch = sample // num_windows)."""
        epoch, i = divmod(int(sample), self.num_windows)
        if not self.shuffle:
            return i * self.seq_len
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        return int(self._perm[i]) * self.seq_len

    def pack(self, samples) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples -> ``(input_ids [1, M * T] long, cu_seqlens [N + 1] int32)``."""
        T, ds = self.seq_len, self.corpus.doc_starts
        ids, cuts = [], [0]
        for m, sample in enumerate(samples):
            s = self.window_start(sample)
            ids.append(np.asarray(self.corpus.tokens[s : s + T], dtype=np.int64))
            inner = ds[np.searchsorted(ds, s, "right") : np.searchsorted(ds, s + T, "left")]
            cuts.extend((inner - s + m * T).tolist())
            cuts.append((m + 1) * T)
        return torch.from_numpy(np.concatenate(ids))[None], torch.tensor(cuts, dtype=torch.int32)

    def batches(self, start_sample: int, batch_size: int, rank: int = 0, world_size: int = 1, micro_batches: int = 1):
        """The micro-batches of the step whose first global sample is ``start_sample``: this rank's
        ``batch_size // world_size`` samples, cut into ``micro_batches`` packed rows."""
        if batch_size % (world_size * micro_batches):
            raise ValueError(f"batch_size ({batch_size}) must be divisible by world_size x grad_accum "
                             f"({world_size} x {micro_batches})")
        per_rank = batch_size // world_size
        per_micro = per_rank // micro_batches
        first = start_sample + rank * per_rank
        return [self.pack(range(first + i * per_micro, first + (i + 1) * per_micro)) for i in range(micro_batches)]


def eval_batches(corpus: TokenCorpus, seq_len: int, num_batches: int, batch_size: int):
    """``num_batches`` packed rows of ``batch_size`` windows spread evenly over ``corpus`` (fixed:
    the same windows every call). Fewer when the corpus is small."""
    w = PackedWindows(corpus, seq_len, shuffle=False)
    total = min(w.num_windows, num_batches * batch_size)
    picks = np.linspace(0, w.num_windows - 1, total).round().astype(np.int64) if total > 1 else np.zeros(1, np.int64)
    picks = np.unique(picks)
    return [w.pack(picks[i : i + batch_size].tolist()) for i in range(0, len(picks), batch_size)]
