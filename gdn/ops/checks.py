"""Argument validation shared by every backend of every op (the op contract of docs/DESIGN.md).

Each check raises ``ValueError`` (bad shape or value) or ``TypeError`` (bad type) naming the
argument, what it got and what was expected, before any backend runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import offsets
from .router import decode_step

BACKENDS = ("naive", "chunk", "triton")


@dataclass(frozen=True)
class Dims:
    """Sizes read off a validated call: batch, length, q/k heads, value heads, key and value dims."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int  # number of sequences (B, or len(cu_seqlens) - 1)
    decode: bool = False  # every sequence exactly one token long (router.decode_step's rule)


def shape_str(x: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in x.shape) + "]"


def float_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def check_backend(backend) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")


def check_scale(scale) -> None:
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")


def check_cu_seqlens(cu_seqlens, B: int, T: int, device: torch.device) -> tuple[int, bool]:
    """Validate packed-sequence offsets; return the number of sequences N and whether the call is a
    decode step (:func:`gdn.ops.router.decode_step`, read off the host copy the checks make)."""
    if cu_seqlens is None:
        return B, T == 1
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a 1-D integer torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must have shape [N+1] with N >= 1, got {shape_str(cu_seqlens)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got dtype {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size B == 1 (sequences packed along T), got B = {B}")
    if torch.compiler.is_compiling():
        # the values are data: reading them here would break the traced graph (eager calls check them)
        return cu_seqlens.numel() - 1, decode_step(T, cu_seqlens)
    c = offsets.host(cu_seqlens)  # one host copy per offsets tensor, whatever the number of layers
    if int(c[0]) != 0 or int(c[-1]) != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got first {int(c[0])} and last {int(c[-1])}")
    if bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {c.tolist()}")
    return cu_seqlens.numel() - 1, decode_step(T, c)


def check_recurrent(q, k, v, g, beta, initial_state, cu_seqlens, scale, backend, *, name_g="g") -> Dims:
    """Validate a call of one of the four recurrent members. ``g``/``beta`` may be None when the
    member has no gate / no delta term (the caller passes None for what it lacks)."""
    q = float_tensor("q", q)
    k = float_tensor("k", k)
    v = float_tensor("v", v)
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {shape_str(q)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q [B, T, H, K] = {shape_str(q)}, got {shape_str(k)}")
    if v.dim() != 4 or v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v must have shape [B, T, HV, V] = [{B}, {T}, HV, V], got {shape_str(v)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"v has HV = {HV} heads, which must be a multiple of the H = {H} heads of q and k")
    if T == 0 or K == 0 or V == 0:
        raise ValueError(f"q and v must be non-empty, got q {shape_str(q)} and v {shape_str(v)}")
    for name, x in ((name_g, g), ("beta", beta)):
        if x is None:
            continue
        float_tensor(name, x)
        if tuple(x.shape) != (B, T, HV):
            raise ValueError(f"{name} must have shape [B, T, HV] = [{B}, {T}, {HV}], got {shape_str(x)}")
    for name, x in (("k", k), ("v", v), (name_g, g), ("beta", beta)):
        if x is not None and x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must share a device")
    check_scale(scale)
    check_backend(backend)
    N, decode = check_cu_seqlens(cu_seqlens, B, T, q.device)
    if initial_state is not None:
        float_tensor("initial_state", initial_state)
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(
                f"initial_state must have shape [N, HV, K, V] = [{N}, {HV}, {K}, {V}], got {shape_str(initial_state)}"
            )
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    return Dims(B, T, H, HV, K, V, N, decode)


def check_attention(q, k, v, cu_seqlens, scale, window_size, backend) -> Dims:
    """Validate a softmax-attention call: q [B, T, HQ, K], k [B, T, HKV, K], v [B, T, HKV, V]."""
    q = float_tensor("q", q)
    k = float_tensor("k", k)
    v = float_tensor("v", v)
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, HQ, K], got {shape_str(q)}")
    B, T, HQ, K = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[1] != T or k.shape[3] != K:
        raise ValueError(f"k must have shape [B, T, HKV, K] = [{B}, {T}, HKV, {K}], got {shape_str(k)}")
    HKV = k.shape[2]
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, HKV):
        raise ValueError(f"v must have shape [B, T, HKV, V] = [{B}, {T}, {HKV}, V], got {shape_str(v)}")
    if HQ % HKV != 0:
        raise ValueError(f"q has HQ = {HQ} heads, which must be a multiple of the HKV = {HKV} heads of k and v")
    if T == 0:
        raise ValueError(f"q must be non-empty, got {shape_str(q)}")
    if window_size is not None:
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be None or a positive int, got {window_size!r}")
    check_scale(scale)
    check_backend(backend)
    N, decode = check_cu_seqlens(cu_seqlens, B, T, q.device)
    return Dims(B, T, HKV, HQ, K, v.shape[3], N, decode)
