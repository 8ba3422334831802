"""Context parallelism: one sequence split along T over the ranks of a group (docs/CONTEXT_PARALLEL.md).

- :class:`ContextParallel`: the group and the token layout of a batch (which slice each rank
  holds, the global ``cu_seqlens``), passed to the ops, the layers and the model's forward.
- :mod:`.recurrent`: the context-parallel recurrent ops (every member of the delta family and
  KDA): per-rank transfer maps, one all-gather per call, an exact correction.
- :mod:`.attention`: softmax attention over a split sequence (the window's halo for sliding-window
  layers; for global ones an all-gather of keys and values, or with ``attention="ring"`` their
  blocks passed rank to rank and merged by log-sum-exp).
- :mod:`.comm`: the collectives with their backward (halo exchange, all-gather) and the batched
  point-to-point transfers of the ring; CUDA tensors pass through host memory under gloo.

This package sits between the ops and the layers: it imports :mod:`gdn.ops` and nothing above.
"""
from __future__ import annotations

from . import attention, recurrent
from .comm import all_gather, halo
from .context import ContextParallel, LocalLayout

__all__ = ["ContextParallel", "LocalLayout", "all_gather", "attention", "halo", "recurrent"]
