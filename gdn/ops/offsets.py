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
on one stream are not ready for another). What is kept is made by :func:`lasting`, so that its
memory never belongs to a CUDA graph's pool. The one kept result a capture reads is the offsets'
host copy (:func:`host`): host values, ready on every stream, which the capture could not make (a
copy to the host waits on the device).
"""
from __future__ import annotations

import functools
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

# id(tensor) -> (weak reference to it, its version when the entries were made, {kind: result})
_MEMO: dict[int, tuple[weakref.ref, int, dict]] = {}


def _drop(key: int, ref: weakref.ref) -> None:
    entry = _MEMO.get(key)
    if entry is not None and entry[0] is ref:  # not a newer tensor that took the same id
        del _MEMO[key]


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CUDA tensor and the current stream is capturing a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def memo(t: torch.Tensor, kind: Any, make: Callable[[], Any]) -> Any:
    """``make()``, computed once per live, unmodified tensor ``t`` and hashable ``kind``."""
    if torch.compiler.is_compiling() or _capturing(t):
        return make()
    if torch.cuda.is_initialized():
        kind = (kind, torch.cuda.current_stream().cuda_stream)
    key, version = id(t), t._version
    entry = _MEMO.get(key)
    if entry is None or entry[0]() is not t or entry[1] != version:
        entry = _MEMO[key] = (weakref.ref(t, lambda ref, k=key: _drop(k, ref)), version, {})
    results = entry[2]
    if kind not in results:
        results[kind] = lasting(make)
    return results[kind]


def lasting(make: Callable[[], Any]) -> Any:
    """``make()``, with the CUDA memory it allocates taken from the caching allocator's own pool,
    for results kept beyond the call (the memos, the dense chunk layouts).

    torch.compile's CUDA graphs (``mode="reduce-overhead"``) warm a graph up by running it eagerly
    while every allocation of the calling thread goes to the graph's private pool, and then refuse
    any tensor of that pool still alive that is not an output. The allocator routes by thread, so
    ``make`` runs on a helper thread, on the caller's current stream (its work stays ordered with
    the caller's). While a CUDA graph captures, ``make()`` runs here: its work must be captured.
    On the helper thread itself (a kept result made from another, such as a packed chunk layout
    from the offsets' host copy) ``make()`` runs in place: waiting on the one helper would never end."""
    if (not torch.cuda.is_initialized() or getattr(_HELPER, "active", False)
            or torch.cuda.is_current_stream_capturing()):
        return make()
    return _worker().submit(_on_stream, torch.cuda.current_stream(), make).result()


_HELPER = threading.local()  # .active: this thread is running a lasting() make


@functools.cache
def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="gdn-lasting")


def _on_stream(stream: torch.cuda.Stream, make: Callable[[], Any]) -> Any:
    _HELPER.active = True
    try:
        with torch.cuda.stream(stream):
            return make()
    finally:
        _HELPER.active = False


def host(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens``'s values on the CPU, int64 (one copy, so one host synchronisation, per tensor).
    While a CUDA graph captures, the copy made before the capture (by an eager call with this same
    tensor, on any stream): a capture cannot copy to the host. ValueError where there is none."""
    if _capturing(cu_seqlens) and not torch.compiler.is_compiling():
        kept = _kept(cu_seqlens, "host")
        if kept is None:
            raise ValueError("cu_seqlens: a CUDA graph captures a packed call only after an eager call with the same "
                             "cu_seqlens tensor (its values are read to the host once, which a capture cannot do), "
                             "or with cu_seqlens on the CPU")
        return kept
    return memo(cu_seqlens, "host", lambda: cu_seqlens.detach().to("cpu", torch.int64))


def _kept(t: torch.Tensor, kind: Any) -> Any:
    """The result of ``kind`` kept for live, unmodified ``t`` on any stream (:func:`memo`), or None."""
    entry = _MEMO.get(id(t))
    if entry is None or entry[0]() is not t or entry[1] != t._version:
        return None
    for key, value in entry[2].items():
        if key == kind or (isinstance(key, tuple) and len(key) == 2 and key[0] == kind):
            return value
    return None


def to_device(cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """Offsets made on the host, on ``device``, with their host copy recorded (:func:`host` then
    reads it instead of copying back: no synchronisation at all)."""
    out = cu_seqlens.to(device, non_blocking=True)
    if out is not cu_seqlens:
        values = cu_seqlens.detach().to("cpu", torch.int64)
        memo(out, "host", lambda: values)
    return out
