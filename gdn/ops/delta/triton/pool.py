"""Serving-engine entry points of the fused recurrent kernel: a state pool updated in place, a
speculative step that keeps the state after every token (with its commit), and CUDA-graph replay.

A serving engine keeps the recurrent states of all live requests in one preallocated pool
``state_pool [P, HV, K, V]`` (float32) and addresses them with ``slot_indices [N]``:

- :func:`fused_recurrent_gated_delta_rule_pool` reads ``state_pool[slot_indices[n]]``, runs the
  sequence's tokens and writes the state back into the same slot, in place. A negative slot marks
  a padding entry (for a batch padded to a captured size): its state is not touched and its
  outputs are zeros.
- :func:`fused_recurrent_gated_delta_rule_spec` runs a short multi-token (speculative) step
  without touching the pool and returns the state after each token, ``states [B, T, HV, K, V]``.
  Once the verifier has accepted ``m`` tokens of sequence ``n``, the state to keep is
  ``states[n, m - 1]`` (packed: ``states[0, cu_seqlens[n] + m - 1]``); :func:`commit_spec_states`
  writes exactly that into the pool on the device, for every sequence at once (``m = 0`` keeps
  the slot as it was). Rolling back rejected tokens is therefore free: nothing was written.
- :class:`DecodeGraph` captures one pool decode step for a fixed batch in a CUDA graph and replays it.
- :func:`fused_recurrent_step_` is the pool whose slot n is row n (no slot indices): a batch of
  states ``[N, HV, K, V]`` updated in place, what a model's fixed-shape decode step runs;
  :func:`fused_gated_delta_rule_step_` is the same from the Gated DeltaNet layer's raw inputs
  (L2 norms, gate and β inside the kernel).

Every launcher here is free of host synchronisation and of data-dependent allocation, so it can
be captured in a CUDA graph. What the device values are NOT checked for (it would need a sync):
slot values (a slot outside ``[0, P)`` other than negatives is treated as padding as well, so no
memory outside the pool is ever touched, but it is a caller bug), distinct slots within one call
(two entries on one slot race), ``cu_seqlens`` values, and ``accepted_len`` range (values outside
``[0, T_n]`` leave the slot unchanged). :func:`check_slot_indices` checks slots on demand (it syncs).
All entry points are inference only (see :mod:`gdn.ops.delta.triton.recurrent`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...checks import shape_str
from ...tuning import OTHER, cdiv, pow2
from ...triton.launch import direct
from .recurrent import (
    check_kernel_inputs,
    check_no_grad,
    contiguous_last,
    launch,
    offsets_on,
)

__all__ = [
    "fused_recurrent_gated_delta_rule_pool",
    "fused_recurrent_step_",
    "fused_gated_delta_rule_step_",
    "fused_recurrent_gated_delta_rule_spec",
    "commit_spec_states",
    "check_slot_indices",
    "DecodeGraph",
]


def _check_pool(state_pool, HV, K, V, device, name="state_pool") -> int:
    if not isinstance(state_pool, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(state_pool).__name__}")
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (HV, K, V):
        raise ValueError(f"{name} must have shape [P, HV, K, V] = [P, {HV}, {K}, {V}], got {shape_str(state_pool)}")
    if state_pool.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {state_pool.dtype}")
    if not state_pool.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is updated in place), got strides {state_pool.stride()}")
    if state_pool.device != device:
        raise ValueError(f"{name} is on {state_pool.device} but q is on {device}")
    return state_pool.shape[0]


def _check_index(name, x, N, device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D int32/int64 torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
    if x.dim() != 1 or x.numel() != N:
        raise ValueError(f"{name} must have shape [N] = [{N}] (one entry per sequence), got {shape_str(x)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}; it must live with the inputs")


def check_slot_indices(slot_indices: torch.Tensor, pool_size: int) -> None:
    """Check slot values on the host (synchronises): each in ``[-inf, pool_size)``, and the
    non-negative ones distinct. The kernels cannot check this without a sync; call it while
    debugging an engine, never inside a captured graph. Raises ValueError."""
    s = slot_indices.detach().to("cpu", torch.int64)
    live = s[s >= 0]
    if bool((live >= pool_size).any()):
        raise ValueError(f"slot_indices must be < pool size {pool_size} (negative = padding), got {s.tolist()}")
    if live.unique().numel() != live.numel():
        raise ValueError(f"slot_indices must not repeat a slot (two updates of one state race), got {s.tolist()}")


def _check_out(out, B, T, HV, V, dtype, device):
    if out is None:
        return torch.empty(B, T, HV, V, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (B, T, HV, V) or out.dtype != dtype:
        got = f"{out.dtype} {shape_str(out)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a {dtype} tensor of shape [B, T, HV, V] = [{B}, {T}, {HV}, {V}], got {got}")
    if not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be contiguous and on {device}")
    return out


def fused_recurrent_gated_delta_rule_pool(q, k, v, g, beta, *, state_pool, slot_indices, scale=None,
                                          cu_seqlens=None, use_qk_l2norm=False, out=None):
    """Gated delta rule on states held in a pool, updated in place (decode step of a serving engine).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV] or None (as in
            :func:`gdn.ops.delta.triton.recurrent.fused_recurrent_gated_delta_rule`). A decode
            step is ``B = N, T = 1``, or ``B = 1`` with ``cu_seqlens``.
        state_pool: [P, HV, K, V] float32, contiguous; ``state_pool[slot_indices[n]]`` is sequence
            n's state before the call and is overwritten with its state after the call's tokens.
        slot_indices: [N] int32/int64 on the inputs' device; negative = padding entry (state
            untouched, outputs zero). Non-negative slots must be distinct and < P (not checked on
            the device; see :func:`check_slot_indices`).
        cu_seqlens: [N + 1] packed offsets (B == 1), optional.
        out: optional preallocated o [B, T, HV, V] in v.dtype (for captured graphs).

    Returns:
        o [B, T, HV, V] in v.dtype.
    """
    B, T, H, HV, K, V, N = check_kernel_inputs(q, k, v, g, beta, scale, cu_seqlens)
    check_no_grad("fused_recurrent_gated_delta_rule_pool", q=q, k=k, v=v, g=g, beta=beta)
    P = _check_pool(state_pool, HV, K, V, q.device)
    _check_index("slot_indices", slot_indices, N, q.device)
    if slot_indices.device.type == "cpu":
        check_slot_indices(slot_indices, P)
    o = _check_out(out, B, T, HV, V, v.dtype, v.device)
    scale = K ** -0.5 if scale is None else scale
    launch(contiguous_last(q), contiguous_last(k), contiguous_last(v), g, beta, o, state_pool, state_pool,
           scale=scale, slots=slot_indices, pool_size=P, cu_seqlens=offsets_on(cu_seqlens, q.device),
           store_ht=True, use_qk_l2norm=use_qk_l2norm, num_sequences=N)
    return o


def fused_recurrent_step_(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False, out=None):
    """One step of every row on its own state, updated in place: ``state[n]`` is row n's state before
    the call and is overwritten with its state after it. Each program reads its slice of the state
    once and writes the same slice once, so nothing else is allocated or copied.

    Args:
        q, k: [N, T, H, K]; v: [N, T, HV, V]; g, beta: [N, T, HV] or None (as in
            :func:`gdn.ops.delta.triton.recurrent.fused_recurrent_gated_delta_rule`).
        state: [N, HV, K, V] float32, contiguous.
        scale, use_qk_l2norm, out: as in :func:`fused_recurrent_gated_delta_rule_pool`.

    Returns:
        o [N, T, HV, V] in v.dtype.
    """
    B, T, H, HV, K, V, N = check_kernel_inputs(q, k, v, g, beta, scale, None)
    check_no_grad("fused_recurrent_step_", q=q, k=k, v=v, g=g, beta=beta)
    if _check_pool(state, HV, K, V, q.device, "state") != N:
        raise ValueError(f"state must have shape [N, HV, K, V] = [{N}, {HV}, {K}, {V}], got {shape_str(state)}")
    o = _check_out(out, B, T, HV, V, v.dtype, v.device)
    scale = K ** -0.5 if scale is None else scale
    launch(contiguous_last(q), contiguous_last(k), contiguous_last(v), g, beta, o, state, state, scale=scale,
           store_ht=True, use_qk_l2norm=use_qk_l2norm, num_sequences=N)
    return o


def fused_gated_delta_rule_step_(q, k, v, a, b, A_log, dt_bias, state, *, scale=None, use_qk_l2norm=True,
                                 allow_neg_eigval=False, out=None):
    """:func:`fused_recurrent_step_` of the Gated DeltaNet layer from its raw inputs, in one launch:
    the kernel L2-normalises q and k (``use_qk_l2norm``) and computes
    ``g = −exp(A_log)·softplus(a + dt_bias)`` and ``β = sigmoid(b)`` (2·sigmoid with
    ``allow_neg_eigval``) itself, the arithmetic of the prologue kernels
    (:mod:`gdn.ops.delta.triton.prologue`), so no prologue launch and no rounding of q̂, k̂ to
    q's dtype in between (the only difference from prologue + step: in half precision q̂, k̂ keep
    fp32).

    Args:
        q, k: [N, 1, H, K]; v: [N, 1, HV, V]; a, b: [N, 1, HV] (any strides with a unit last
            stride: the decode step's column slices are read in place); A_log, dt_bias: [HV].
        state: [N, HV, K, V] float32, contiguous, updated in place.

    Returns:
        o [N, 1, HV, V] in v.dtype.
    """
    B, T, H, HV, K, V, N = check_kernel_inputs(q, k, v, a, b, scale, None)
    check_no_grad("fused_gated_delta_rule_step_", q=q, k=k, v=v, a=a, b=b)
    if _check_pool(state, HV, K, V, q.device, "state") != N:
        raise ValueError(f"state must have shape [N, HV, K, V] = [{N}, {HV}, {K}, {V}], got {shape_str(state)}")
    o = _check_out(out, B, T, HV, V, v.dtype, v.device)
    scale = K ** -0.5 if scale is None else scale
    launch(contiguous_last(q), contiguous_last(k), contiguous_last(v), contiguous_last(a), contiguous_last(b), o,
           state, state, scale=scale, store_ht=True, use_qk_l2norm=use_qk_l2norm, num_sequences=N,
           raw_gate=(A_log.contiguous(), dt_bias.contiguous()), neg_eigval=allow_neg_eigval)
    return o


def fused_recurrent_gated_delta_rule_spec(q, k, v, g, beta, *, scale=None, initial_state=None, state_pool=None,
                                          slot_indices=None, cu_seqlens=None, use_qk_l2norm=False,
                                          intermediate_states=None, out=None):
    """A short multi-token step that keeps the state after every token, for speculative decoding.

    The starting states come from ``initial_state [N, HV, K, V]``, or from
    ``state_pool[slot_indices]`` (the pool is only read), or are zeros. Nothing is written to the
    pool: after verification, keep ``states[n, m - 1]`` for ``m`` accepted tokens (packed:
    ``states[0, cu_seqlens[n] + m - 1]``), e.g. with :func:`commit_spec_states`.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV] or None; cu_seqlens: [N + 1] or None.
        initial_state: [N, HV, K, V] (cast to float32), exclusive with ``state_pool``.
        state_pool, slot_indices: as in :func:`fused_recurrent_gated_delta_rule_pool`; a padding
            entry's outputs are zeros and its ``states`` rows are unspecified.
        intermediate_states: optional preallocated [B, T, HV, K, V] float32 contiguous buffer.
        out: optional preallocated o [B, T, HV, V] in v.dtype.

    Returns:
        ``(o [B, T, HV, V] in v.dtype, states [B, T, HV, K, V] float32)``: ``states[b, t]`` is the
        state right after token t of row b (packed: of the sequence that token t belongs to).
    """
    B, T, H, HV, K, V, N = check_kernel_inputs(q, k, v, g, beta, scale, cu_seqlens, initial_state)
    check_no_grad("fused_recurrent_gated_delta_rule_spec", q=q, k=k, v=v, g=g, beta=beta,
                  initial_state=initial_state)
    if initial_state is not None and state_pool is not None:
        raise ValueError("give initial_state or state_pool (with slot_indices), not both")
    if (state_pool is None) != (slot_indices is None):
        raise ValueError("state_pool and slot_indices go together: give both or neither")
    P, h0 = 0, None
    if state_pool is not None:
        P = _check_pool(state_pool, HV, K, V, q.device)
        _check_index("slot_indices", slot_indices, N, q.device)
        h0 = state_pool
    elif initial_state is not None:
        h0 = initial_state.to(torch.float32).contiguous()
    if intermediate_states is None:
        states = torch.empty(B, T, HV, K, V, dtype=torch.float32, device=q.device)
    else:
        states = intermediate_states
        if (not isinstance(states, torch.Tensor) or tuple(states.shape) != (B, T, HV, K, V)
                or states.dtype != torch.float32 or not states.is_contiguous() or states.device != q.device):
            raise ValueError(f"intermediate_states must be a contiguous float32 tensor of shape [B, T, HV, K, V] = "
                             f"[{B}, {T}, {HV}, {K}, {V}] on {q.device}")
    o = _check_out(out, B, T, HV, V, v.dtype, v.device)
    scale = K ** -0.5 if scale is None else scale
    launch(contiguous_last(q), contiguous_last(k), contiguous_last(v), g, beta, o, h0, states, scale=scale,
           slots=slot_indices, pool_size=P, cu_seqlens=offsets_on(cu_seqlens, q.device), store_all=True,
           use_qk_l2norm=use_qk_l2norm, num_sequences=N)
    return o, states


@triton.jit
def _commit_kernel(states, pool, slots, accepted, cu_seqlens, T, P,
                   HV: tl.constexpr, KV: tl.constexpr, BLOCK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Grid ``(N * HV, cdiv(K * V, BLOCK))``: pool[slot_n, hv] = states[token of the last accepted, hv]."""
    i_nh = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        t_n = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n * T
        t_n = i_n * 0 + T
    m = tl.load(accepted + i_n).to(tl.int64)
    slot = tl.load(slots + i_n).to(tl.int64)
    ok = (slot >= 0) & (slot < P) & (m >= 1) & (m <= t_n)
    src = tl.where(ok, bos + m - 1, 0)
    dst = tl.where(ok, slot, 0)
    o_x = i_b * BLOCK + tl.arange(0, BLOCK)
    mask = (o_x < KV) & ok
    b_x = tl.load(states + (src * HV + i_hv) * KV + o_x, mask=mask)
    tl.store(pool + (dst * HV + i_hv) * KV + o_x, b_x, mask=mask)


def commit_spec_states(state_pool, slot_indices, states, accepted_len, *, cu_seqlens=None) -> None:
    """Write the state after each sequence's last accepted token into its pool slot, on the device.

    Args:
        state_pool: [P, HV, K, V] float32, updated in place.
        slot_indices: [N] int32/int64 (negative = padding, skipped).
        states: [B, T, HV, K, V] float32 from :func:`fused_recurrent_gated_delta_rule_spec`.
        accepted_len: [N] int32/int64, tokens of the step accepted per sequence: ``m >= 1`` keeps
            ``states`` after token ``m - 1``; ``m = 0`` (all rejected) leaves the slot unchanged,
            as does any ``m`` outside ``[0, T_n]`` (not checked on the device).
        cu_seqlens: [N + 1] offsets when the step was packed (then B == 1).
    """
    if not isinstance(states, torch.Tensor) or states.dim() != 5 or states.dtype != torch.float32:
        raise ValueError("states must be the float32 [B, T, HV, K, V] tensor of fused_recurrent_gated_delta_rule_spec")
    if not states.is_contiguous():
        raise ValueError("states must be contiguous")
    B, T, HV, K, V = states.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens requires states with B == 1, got {shape_str(states)}")
    P = _check_pool(state_pool, HV, K, V, states.device)
    _check_index("slot_indices", slot_indices, N, states.device)
    _check_index("accepted_len", accepted_len, N, states.device)
    if cu_seqlens is not None:
        _check_index("cu_seqlens", cu_seqlens, N + 1, states.device)
    c = OTHER["pool_commit"]
    BLOCK = min(c["BLOCK"], pow2(K * V, 1))
    grid = (N * HV, cdiv(K * V, BLOCK))
    direct(_commit_kernel, grid, states, state_pool, slot_indices, accepted_len,
           states if cu_seqlens is None else cu_seqlens, T, P,
           HV=HV, KV=K * V, BLOCK=BLOCK, IS_VARLEN=cu_seqlens is not None, num_warps=c["num_warps"])


class DecodeGraph:
    """One decode step on a state pool, captured in a CUDA graph for a fixed batch and replayed.

    Static buffers (write into them, then :meth:`replay`; or pass tensors to ``__call__``):
    ``q, k`` [N, T, H, K], ``v`` [N, T, HV, V], ``g, beta`` [N, T, HV] float32 (None when the member
    lacks them), ``slot_indices`` [N] int32, and the output ``o`` [N, T, HV, V]. The pool is updated
    in place at each replay. Capture runs the kernel once with every slot set to padding (-1), so
    building the graph leaves the pool untouched.

    Args:
        state_pool: [P, HV, K, V] float32 CUDA tensor.
        batch_size: N, entries per step (pad with slot -1).
        num_heads: H (q/k heads); HV, K, V are read off the pool.
        dtype: dtype of q, k, v and o.
        tokens: T, tokens per entry and step (1 for decode).
        gated, delta: whether the member has the gate g / the delta term (beta).
        scale, use_qk_l2norm: as in :func:`fused_recurrent_gated_delta_rule_pool`.
    """

    def __init__(self, state_pool, batch_size, num_heads, *, dtype=torch.bfloat16, tokens=1, gated=True, delta=True,
                 scale=None, use_qk_l2norm=False):
        if not isinstance(state_pool, torch.Tensor) or not state_pool.is_cuda:
            raise ValueError("DecodeGraph needs a CUDA state_pool")
        if state_pool.dim() != 4:
            raise ValueError(f"state_pool must have shape [P, HV, K, V], got {shape_str(state_pool)}")
        _, HV, K, V = state_pool.shape
        dev, N, T, H = state_pool.device, batch_size, tokens, num_heads
        self.state_pool = state_pool
        self.scale = scale
        self.use_qk_l2norm = use_qk_l2norm
        self.q = torch.zeros(N, T, H, K, dtype=dtype, device=dev)
        self.k = torch.zeros(N, T, H, K, dtype=dtype, device=dev)
        self.v = torch.zeros(N, T, HV, V, dtype=dtype, device=dev)
        self.g = torch.zeros(N, T, HV, dtype=torch.float32, device=dev) if gated else None
        self.beta = torch.zeros(N, T, HV, dtype=torch.float32, device=dev) if delta else None
        self.slot_indices = torch.full((N,), -1, dtype=torch.int32, device=dev)
        self.o = torch.empty(N, T, HV, V, dtype=dtype, device=dev)
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side), torch.inference_mode():
            self._step()  # compiles the kernel outside the capture
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self._step()

    def _step(self):
        fused_recurrent_gated_delta_rule_pool(
            self.q, self.k, self.v, self.g, self.beta, state_pool=self.state_pool, slot_indices=self.slot_indices,
            scale=self.scale, use_qk_l2norm=self.use_qk_l2norm, out=self.o)

    def replay(self) -> torch.Tensor:
        """Run the captured step on the current buffer contents; returns the static ``o``."""
        self.graph.replay()
        return self.o

    def __call__(self, q, k, v, g=None, beta=None, *, slot_indices) -> torch.Tensor:
        """Copy the inputs into the static buffers and replay. Returns the static ``o`` (overwritten
        by the next call; clone it to keep it)."""
        for name, src in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("slot_indices", slot_indices)):
            dst = getattr(self, name)
            if (dst is None) != (src is None):
                raise ValueError(f"{name} must be {'None' if dst is None else 'given'} for this captured member")
            if dst is not None:
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"{name} must have shape {shape_str(dst)}, got {shape_str(src)}")
                dst.copy_(src)
        return self.replay()
