"""The layout of a context-parallel batch: which tokens of the global sequence each rank holds.

A :class:`ContextParallel` is made once per batch (every rank of the group makes the same one) and
passed to the context-parallel ops and layers. Rank ``r`` of the group holds the contiguous slice
``[bounds[r], bounds[r+1])`` of the token axis (dim 1 of ``[B, T, ...]`` tensors). Either every
batch row is one sequence spread over the ranks (``cu_seqlens`` None), or B == 1 and global
``cu_seqlens`` pack sequences along T; a sequence may then start, end or cross anywhere, also
across any number of rank boundaries.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ContextParallel", "LocalLayout", "ATTENTION"]

#: The ways global attention reaches earlier ranks' keys (:mod:`gdn.distributed.attention`).
ATTENTION = ("gather", "ring")


@dataclass(frozen=True)
class LocalLayout:
    """What one rank's slice ``[start, end)`` holds of the global sequences.

    Attributes:
        cu: offsets [N' + 1] (local positions) of the N' sequences that have tokens in the slice,
            None when every batch row is one sequence.
        index: the global index of each of those N' sequences (packed), or ``range(B)`` (rows).
        carry_in: tokens at the start of the slice that continue a sequence begun on an earlier
            rank (0: the slice starts at a sequence start). Packed: local sequence 0 is that
            sequence; rows: every row continues (carry_in = slice length, ranks > 0).
        carry_out: the last local sequence (packed) or every row continues on the next rank.
        owned: ``(global sequence, local sequence or None)`` of the sequences whose final state this
            rank returns: those ending in the slice, and empty ones starting in it (local None).
    """

    cu: tuple[int, ...] | None
    index: tuple[int, ...]
    carry_in: int
    carry_out: bool
    owned: tuple[tuple[int, int | None], ...]


def _group_of(group):
    """A ProcessGroup from a ProcessGroup, a one-dimensional DeviceMesh, or None (the default group)."""
    if group is None:
        return dist.group.WORLD
    if hasattr(group, "get_group"):  # DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"a DeviceMesh for context parallelism must be one-dimensional, got {group.ndim} dims: "
                             "pass mesh['cp']")
        return group.get_group()
    return group


class ContextParallel:
    """A context-parallel group and the token layout of the current batch.

    Args:
        group: the ranks sharing one sequence: a ``ProcessGroup``, a one-dimensional ``DeviceMesh``
            (e.g. ``mesh["cp"]``) or None (the default group). ``torch.distributed`` must be
            initialised.
        bounds: ``size + 1`` non-decreasing global token offsets, ``bounds[0] = 0``: rank r holds
            tokens ``[bounds[r], bounds[r+1])``, at least one each. :meth:`split` cuts evenly.
        cu_seqlens: global offsets [N + 1] of sequences packed along T (then B == 1; ``cu[-1]``
            must be ``bounds[-1]``), a tensor or a sequence of ints; None: every row is one sequence.
        attention: how global softmax attention reaches the keys of earlier ranks
            (:mod:`gdn.distributed.attention`): ``"gather"`` (the default: one all-gather of keys and
            values, then fused SDPA; O(T) keys per rank) or ``"ring"`` (key/value blocks passed rank
            to rank with an online softmax; O(T_r) keys per rank, attention in PyTorch matrix
            products). Sliding-window layers take the halo either way.

    Everything here is host-side bookkeeping (Python ints), computed once per batch; device tensors
    built from it are cached per device.
    """

    def __init__(self, group, bounds, cu_seqlens=None, attention: str = "gather"):
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        self.attention = attention
        self.group = _group_of(group)
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.bounds = tuple(int(b) for b in bounds)
        if len(self.bounds) != self.size + 1 or self.bounds[0] != 0:
            raise ValueError(f"bounds must hold size + 1 = {self.size + 1} offsets starting at 0, got {self.bounds}")
        if any(b <= a for a, b in zip(self.bounds[:-1], self.bounds[1:])):
            raise ValueError(f"every rank needs at least one token: bounds must increase, got {self.bounds}")
        if cu_seqlens is not None:
            cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
            cu = [int(c) for c in cu]
            if len(cu) < 2 or cu[0] != 0 or cu[-1] != self.bounds[-1] or any(b < a for a, b in zip(cu[:-1], cu[1:])):
                raise ValueError(f"cu_seqlens must be non-decreasing offsets from 0 to the total length "
                                 f"{self.bounds[-1]}, got {cu if len(cu) < 12 else cu[:6] + ['...'] + cu[-3:]}")
            self.cu_seqlens = tuple(cu)
        else:
            self.cu_seqlens = None
        self.start, self.end = self.bounds[self.rank], self.bounds[self.rank + 1]
        self._layout = None
        self._cache: dict = {}

    @classmethod
    def split(cls, group, total: int, cu_seqlens=None, attention: str = "gather") -> "ContextParallel":
        """Even slices of ``total`` tokens (the first ``total % size`` ranks get one more)."""
        size = dist.get_world_size(_group_of(group))
        if total < size:
            raise ValueError(f"{total} tokens cannot be split over {size} ranks (one token each at least)")
        base, extra = divmod(total, size)
        bounds = [0]
        for r in range(size):
            bounds.append(bounds[-1] + base + (r < extra))
        return cls(group, bounds, cu_seqlens, attention)

    @property
    def length(self) -> int:
        """Tokens on this rank."""
        return self.end - self.start

    @property
    def total(self) -> int:
        """Tokens of the whole sequence (all ranks)."""
        return self.bounds[-1]

    @property
    def min_length(self) -> int:
        """The fewest tokens any rank holds."""
        return min(b - a for a, b in zip(self.bounds[:-1], self.bounds[1:]))

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of a global tensor along ``dim`` (the token axis)."""
        if x.shape[dim] != self.total:
            raise ValueError(f"expected {self.total} tokens along dim {dim}, got shape {tuple(x.shape)}")
        return x.narrow(dim, self.start, self.length)

    # ---- layout ------------------------------------------------------------------------------
    @property
    def layout(self) -> LocalLayout:
        """The :class:`LocalLayout` of this rank (computed on first use)."""
        if self._layout is None:
            self._layout = self._make_layout()
        return self._layout

    def _make_layout(self) -> LocalLayout:
        s, e, last = self.start, self.end, self.rank == self.size - 1
        cu = self.cu_seqlens
        if cu is None:
            return LocalLayout(None, (), self.length if self.rank else 0, not last, ())
        N = len(cu) - 1
        # sequences with a token in [s, e): n with cu[n] < e and cu[n+1] > s
        first = bisect.bisect_right(cu, s) - 1  # the sequence holding token s (the last one starting <= s)
        local, index = [0], []
        n = first
        while n < N and cu[n] < e:
            if max(cu[n], s) < min(cu[n + 1], e):  # has tokens here (empty sequences have none)
                index.append(n)
                local.append(min(cu[n + 1], e) - s)
            n += 1
        carry_in = local[1] if cu[index[0]] < s else 0
        carry_out = cu[index[-1] + 1] > e
        owned = []
        for j, n in enumerate(index):
            if s < cu[n + 1] <= e:
                owned.append((n, j))
        # empty sequences belong to the rank holding their start (the last rank: those at the end)
        lo = bisect.bisect_left(cu, s)
        hi = bisect.bisect_left(cu, e) if not last else len(cu)
        for n in range(lo, min(hi, N)):
            if cu[n] == cu[n + 1]:
                owned.append((n, None))
        owned.sort()
        return LocalLayout(tuple(local), tuple(index), carry_in, carry_out, tuple(owned))

    def local_cu_seqlens(self, device) -> torch.Tensor | None:
        """The local offsets of :attr:`LocalLayout.cu` as an int32 tensor on ``device`` (None: rows)."""
        if self.cu_seqlens is None:
            return None
        return self._cached(("cu", str(device)), lambda: torch.tensor(self.layout.cu, dtype=torch.int32,
                                                                      device=device))

    def halo_cu_seqlens(self, width: int, device) -> torch.Tensor | None:
        """Offsets of the sequences in the ``width + length`` tokens ``[start − width, end)`` (the slice
        with the ``width`` tokens before it): cuts at every sequence start inside, and at global
        position 0 (positions before it are padding, a sequence of their own). None: rows."""
        if self.cu_seqlens is None:
            return None

        def make():
            lo = self.start - width
            cuts = {0, width + self.length}
            for c in self.cu_seqlens:
                if lo < c < self.end:
                    cuts.add(c - lo)
            return torch.tensor(sorted(cuts), dtype=torch.int32, device=device)

        return self._cached(("halo", width, str(device)), make)

    def positions(self, device) -> torch.Tensor:
        """[length] position of each local token within its sequence (RoPE positions)."""
        def make():
            t = torch.arange(self.start, self.end, device=device)
            if self.cu_seqlens is None:
                return t
            cu = torch.tensor(self.cu_seqlens, dtype=torch.long, device=device)
            return t - cu[torch.bucketize(t, cu[1:], right=True)]

        return self._cached(("pos", str(device)), make)

    def sequence_ids(self, lo: int, hi: int, device) -> torch.Tensor | None:
        """[hi − lo] global sequence index of the global positions ``[lo, hi)`` (−1 before 0); None: rows."""
        if self.cu_seqlens is None:
            return None
        t = torch.arange(lo, hi, device=device)
        cu = self._cached(("cu_global", str(device)),
                          lambda: torch.tensor(self.cu_seqlens, dtype=torch.long, device=device))
        seq = torch.bucketize(t, cu[1:], right=True)
        return torch.where(t < 0, torch.full_like(seq, -1), seq)

    def sequence_start(self, pos: int) -> int:
        """Global position where the sequence holding global token ``pos`` starts (0 for rows)."""
        if self.cu_seqlens is None:
            return 0
        return self.cu_seqlens[bisect.bisect_right(self.cu_seqlens, pos) - 1]

    def rank_of(self, pos: int) -> int:
        """The rank whose slice holds global token ``pos``."""
        return bisect.bisect_right(self.bounds, pos) - 1

    def first_visible_rank(self, rank: int) -> int:
        """The lowest rank holding a key that a query of ``rank`` sees under causal attention: the
        one holding the start of the sequence that ``rank``'s first token belongs to."""
        return self.rank_of(self.sequence_start(self.bounds[rank]))

    def _cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def __repr__(self) -> str:
        n = None if self.cu_seqlens is None else len(self.cu_seqlens) - 1
        return (f"ContextParallel(rank {self.rank} of {self.size}, tokens [{self.start}, {self.end}) of {self.total}, "
                f"{'rows' if n is None else f'{n} packed sequences'}, attention {self.attention!r})")
