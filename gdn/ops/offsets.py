"""What the ops derive from packed offsets, derived once per offsets tensor.

A packed batch's ``cu_seqlens`` [N+1] reaches every layer of a model, and each layer's ops derive
the same things from it: its values on the host (the argument checks, the chunk layout), the chunk
layout itself, every token's position in its sequence. On a GPU each host copy of a device tensor
synchronises the host with the device (the host then waits for all queued work before it can
queue more), and each derived tensor is a few small kernels: a 24-layer forward paid them per op.
:func:`memo` keeps one result per (tensor, kind) for as long as that tensor object lives and is not
modified in place (its version counter; a write through ``.data`` is not counted). Results are
shared: callers must not modify them.

Nothing is kept while ``torch.compile`` traces or a CUDA graph captures (a value made there is
not valid outside it), and a result is kept per CUDA stream (device tensors made by work queued
on one stream are not ready for another).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

# id(tensor) -> (weak reference to it, its version when the entries were made, {kind: result})
_MEMO: dict[int, tuple[weakref.ref, int, dict]] = {}


def _drop(key: int, ref: weakref.ref) -> None:
    entry = _MEMO.get(key)
    if entry is not None and entry[0] is ref:  # not a newer tensor that took the same id
        del _MEMO[key]


def memo(t: torch.Tensor, kind: Any, make: Callable[[], Any]) -> Any:
    """``make()``, computed once per live, unmodified tensor ``t`` and hashable ``kind``."""
    if torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        return make()
    if torch.cuda.is_initialized():
        kind = (kind, torch.cuda.current_stream().cuda_stream)
    key, version = id(t), t._version
    entry = _MEMO.get(key)
    if entry is None or entry[0]() is not t or entry[1] != version:
        entry = _MEMO[key] = (weakref.ref(t, lambda ref, k=key: _drop(k, ref)), version, {})
    results = entry[2]
    if kind not in results:
        results[kind] = make()
    return results[kind]


def host(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens``'s values on the CPU, int64 (one copy, so one host synchronisation, per tensor)."""
    return memo(cu_seqlens, "host", lambda: cu_seqlens.detach().to("cpu", torch.int64))


def to_device(cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """Offsets made on the host, on ``device``, with their host copy recorded (:func:`host` then
    reads it instead of copying back: no synchronisation at all)."""
    out = cu_seqlens.to(device, non_blocking=True)
    if out is not cu_seqlens:
        values = cu_seqlens.detach().to("cpu", torch.int64)
        memo(out, "host", lambda: values)
    return out
