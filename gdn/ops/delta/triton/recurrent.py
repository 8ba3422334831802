"""Fused recurrent kernel: the recurrence (docs/DESIGN.md) for decode and short prefills (forward only).

One program owns one (sequence, value head, V-tile): it reads its ``[K, BV]`` slice of the state
once, loops over the sequence's tokens with the state in registers, and writes the slice once.
Columns of the state are independent under every member's update (the delta term ``S^T k`` and the
read ``S^T q`` reduce over K only), so tiling V is exact. Per token::

    S = exp(g_t) S                       (USE_G)
    v' = beta_t (v_t - S^T k_t)          (USE_BETA; else v' = v_t)
    S = S + k_t v'^T
    o_t = scale S^T q_t

The same kernel serves four launchers: the plain op (this module), the state pool updated in place,
the speculative step that keeps the state after every token, and (through the pool) CUDA-graph
replay (:mod:`gdn.ops.delta.triton.pool`).

These entry points are **inference only**: they build no autograd graph, and raise ``ValueError``
when grad mode is on and an input requires grad. A router may send a call here exactly when::

    not (torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                         for x in (q, k, v, g, beta, initial_state)))
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...checks import check_recurrent, check_scale, float_tensor, shape_str
from ...gates import L2NORM_EPS
from ...triton.common import tl_sum
from ...triton.launch import direct
from ...tuning import MAX_HEAD_DIM, cdiv, recurrent_tiles

__all__ = [
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_linear_attention",
    "fused_recurrent_linear_attention",
]

_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _fused_recurrent_fwd_kernel(
    q, k, v, g, beta, A_log, dt_bias, o, h0, ht, slots, cu_seqlens,
    scale, T, P,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
    s_gb, s_gt, s_gh, s_bb, s_bt, s_bh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_BETA: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
    USE_SLOTS: tl.constexpr, STORE_ALL: tl.constexpr, IS_VARLEN: tl.constexpr, USE_L2NORM: tl.constexpr,
    EPS: tl.constexpr, RAW_GATE: tl.constexpr, NEG_EIGVAL: tl.constexpr,
):
    """Grid ``(N * HV, cdiv(V, BV))``.

    Plain: state in ``h0[n]`` (USE_H0), out to ``ht[n]`` (STORE_HT). Pool (USE_SLOTS): state in
    ``h0[slots[n]]``, out to ``ht[slots[n]]`` (ht is h0 for in-place); a slot outside ``[0, P)`` is
    padding: its state is neither read nor written and its outputs are zeros. STORE_ALL: the
    state after every token goes to ``ht[token]``, ``ht`` laid out ``[B * T, HV, K, V]`` like the tokens.
    RAW_GATE: ``g`` and ``beta`` hold the raw pre-activations a and b of the Gated DeltaNet layer,
    turned here into ``g = −exp(A_log[h]) softplus(a + dt_bias[h])`` and ``β = (1 or 2)·sigmoid(b)``
    with the arithmetic of :func:`gdn.ops.delta.triton.prologue.gate_fwd_kernel` (so the same
    values), which saves that kernel's launch.
    """
    i_nh = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)

    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        i_b = i_n * 0
    else:
        bos = i_n * 0
        eos = bos + T
        i_b = i_n
    tok0 = i_b * T + bos  # global index of the sequence's first token in the flattened [B * T]

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    o_h = o_k[:, None] * V + o_v[None, :]

    if USE_SLOTS:
        slot = tl.load(slots + i_n).to(tl.int64)
        valid = (slot >= 0) & (slot < P)
        row = tl.where(valid, slot, 0)
        m_state = m_h & valid
    else:
        valid = True
        row = i_n
        m_state = m_h
    p_state = (row * HV + i_hv) * K * V + o_h

    if RAW_GATE:
        c_decay = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        c_bias = tl.load(dt_bias + i_hv).to(tl.float32)

    if USE_H0:
        b_h = tl.load(h0 + p_state, mask=m_state, other=0.0).to(tl.float32)
    else:
        b_h = tl.full([BK, BV], 0.0, dtype=tl.float32)

    p_q = q + i_b * s_qb + bos * s_qt + i_h * s_qh + o_k
    p_k = k + i_b * s_kb + bos * s_kt + i_h * s_kh + o_k
    p_v = v + i_b * s_vb + bos * s_vt + i_hv * s_vh + o_v
    p_g = g + i_b * s_gb + bos * s_gt + i_hv * s_gh
    p_beta = beta + i_b * s_bb + bos * s_bt + i_hv * s_bh
    p_o = o + (tok0 * HV + i_hv) * V + o_v
    p_all = ht + (tok0 * HV + i_hv) * K * V + o_h

    # Token t's inputs are loaded one iteration ahead (software prefetch), so their memory latency
    # overlaps the previous token's arithmetic; a while loop because the interpreter cannot run a
    # for loop over loaded bounds.
    live = bos < eos
    b_q = tl.load(p_q, mask=m_k & live, other=0.0)
    b_k = tl.load(p_k, mask=m_k & live, other=0.0)
    b_v = tl.load(p_v, mask=m_v & live, other=0.0)
    if USE_G:
        b_g = tl.load(p_g, mask=live, other=0.0)
    if USE_BETA:
        b_beta = tl.load(p_beta, mask=live, other=0.0)
    i_t = bos
    while i_t < eos:
        nxt = i_t + 1 < eos
        p_q += s_qt
        p_k += s_kt
        p_v += s_vt
        n_q = tl.load(p_q, mask=m_k & nxt, other=0.0)
        n_k = tl.load(p_k, mask=m_k & nxt, other=0.0)
        n_v = tl.load(p_v, mask=m_v & nxt, other=0.0)
        if USE_G:
            p_g += s_gt
            n_g = tl.load(p_g, mask=nxt, other=0.0)
        if USE_BETA:
            p_beta += s_bt
            n_beta = tl.load(p_beta, mask=nxt, other=0.0)

        c_q = b_q.to(tl.float32)
        c_k = b_k.to(tl.float32)
        c_v = b_v.to(tl.float32)
        if USE_L2NORM:
            c_q = c_q / tl.sqrt(tl_sum(c_q * c_q, 0) + EPS)
            c_k = c_k / tl.sqrt(tl_sum(c_k * c_k, 0) + EPS)
        c_q = c_q * scale
        # Both reads use the state before this token, so they are independent reductions:
        # o = S_new^T q = decay * (S^T q) + (k . q) * u, with u the written value.
        b_sq = tl_sum(b_h * c_q[:, None], 0)
        if USE_BETA:
            b_sk = tl_sum(b_h * c_k[:, None], 0)
        if USE_G:
            c_g = b_g.to(tl.float32)
            if RAW_GATE:
                c_x = c_g + c_bias
                c_g = c_decay * tl.where(c_x > 20.0, c_x, tl.log(1.0 + tl.exp(tl.minimum(c_x, 20.0))))
            decay = tl.exp(c_g)
            b_h = b_h * decay
            b_sq = b_sq * decay
            if USE_BETA:
                b_sk = b_sk * decay
        if USE_BETA:
            c_beta = b_beta.to(tl.float32)
            if RAW_GATE:
                c_beta = tl.sigmoid(c_beta)
                if NEG_EIGVAL:
                    c_beta = 2.0 * c_beta
            b_u = c_beta * (c_v - b_sk)
        else:
            b_u = c_v
        b_h = b_h + c_k[:, None] * b_u[None, :]
        b_o = b_sq + tl_sum(c_k * c_q, 0) * b_u
        if USE_SLOTS:
            b_o = tl.where(valid, b_o, 0.0)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)
        if STORE_ALL:
            tl.store(p_all, b_h, mask=m_h)
        p_o += HV * V
        p_all += HV * K * V
        b_q = n_q
        b_k = n_k
        b_v = n_v
        if USE_G:
            b_g = n_g
        if USE_BETA:
            b_beta = n_beta
        i_t += 1

    if STORE_HT:
        tl.store(ht + p_state, b_h, mask=m_state)


def launch(q, k, v, g, beta, o, h0, ht, *, scale, slots=None, pool_size=0, cu_seqlens=None, store_ht=False,
           store_all=False, use_qk_l2norm=False, num_sequences, tiles=None, raw_gate=None, neg_eigval=False):
    """Launch the kernel on validated arguments (no checks here).

    q, k: [B, T, H, K] (last dim contiguous); v: [B, T, HV, V] (last dim contiguous); g, beta:
    [B, T, HV] or None; o: [B, T, HV, V] contiguous, written; h0: state source (``[N, HV, K, V]``, or
    the pool ``[P, HV, K, V]`` when ``slots`` is given) or None for zeros; ht: state destination
    (``[N, HV, K, V]``, the pool, or ``[B, T, HV, K, V]`` when ``store_all``) or None. ``tiles``
    overrides ``(BV, num_warps)`` (benchmarks). ``raw_gate``: ``(A_log, dt_bias)`` [HV] each when g
    and beta are the raw a and b of the Gated DeltaNet layer (the kernel computes the gate and β,
    ``neg_eigval``: β = 2·sigmoid); g, beta, q, k, v may be any strided views with a unit last stride.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BK, BV, num_warps = recurrent_tiles(num_sequences * HV, K, V)
    if tiles is not None:
        BV, num_warps = tiles
    dummy = o
    grid = (num_sequences * HV, cdiv(V, BV))
    gs = g.stride() if g is not None else (0, 0, 0)
    bs = beta.stride() if beta is not None else (0, 0, 0)
    direct(
        _fused_recurrent_fwd_kernel, grid,
        q, k, v, dummy if g is None else g, dummy if beta is None else beta,
        dummy if raw_gate is None else raw_gate[0], dummy if raw_gate is None else raw_gate[1], o,
        dummy if h0 is None else h0, dummy if ht is None else ht,
        dummy if slots is None else slots, dummy if cu_seqlens is None else cu_seqlens,
        float(scale), T, pool_size,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), gs[0], gs[1], gs[2], bs[0], bs[1], bs[2],
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        USE_G=g is not None, USE_BETA=beta is not None, USE_H0=h0 is not None, STORE_HT=store_ht,
        USE_SLOTS=slots is not None, STORE_ALL=store_all, IS_VARLEN=cu_seqlens is not None,
        USE_L2NORM=use_qk_l2norm, EPS=L2NORM_EPS, RAW_GATE=raw_gate is not None, NEG_EIGVAL=bool(neg_eigval),
        num_warps=num_warps, num_stages=1,
    )


def check_no_grad(fn_name: str, **tensors) -> None:
    """Raise ValueError when grad mode is on and one of ``tensors`` requires grad (forward-only kernels)."""
    if not torch.is_grad_enabled():
        return
    for name, x in tensors.items():
        if x is not None and x.requires_grad:
            raise ValueError(
                f"{name} requires grad, but {fn_name} is inference-only (no backward): call it under "
                "torch.no_grad() / torch.inference_mode(), or use the chunked backend for training"
            )


def contiguous_last(x):
    """``x`` with a unit stride on its last dimension (a copy only when it lacks one)."""
    return x if x is None or x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def check_kernel_inputs(q, k, v, g, beta, scale, cu_seqlens, initial_state=None, *, state_name="initial_state"):
    """Shape checks shared by every fused-recurrent entry point. Returns ``(B, T, H, HV, K, V, N)``.

    ``cu_seqlens`` values (start 0, end T, non-decreasing) are checked only when it lives on the
    CPU: checking a device tensor would synchronise with the host. Its shape and dtype always are.
    ``initial_state`` is checked only for its leading ``[N, HV, K, V]`` shape, when given.
    """
    check_scale(scale)
    dev_offsets = cu_seqlens is not None and isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type != "cpu"
    dims = check_recurrent(q, k, v, g, beta, None, None if dev_offsets else cu_seqlens, scale, None)
    B, T, H, HV, K, V, N = dims.B, dims.T, dims.H, dims.HV, dims.K, dims.V, dims.N
    if dev_offsets:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be an int32/int64 tensor of shape [N+1], N >= 1, got "
                             f"{cu_seqlens.dtype} {shape_str(cu_seqlens)}")
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size B == 1 (sequences packed along T), got B = {B}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
        N = cu_seqlens.numel() - 1
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x is not None and x.dtype not in _INPUT_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16 for the triton backend, got {x.dtype} "
                            "(use backend='chunk' or 'naive' for float64)")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the fused recurrent kernel supports K, V <= {MAX_HEAD_DIM}, got K = {K}, V = {V}")
    if initial_state is not None:
        float_tensor(state_name, initial_state)
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(f"{state_name} must have shape [N, HV, K, V] = [{N}, {HV}, {K}, {V}], "
                             f"got {shape_str(initial_state)}")
        if initial_state.device != q.device:
            raise ValueError(f"{state_name} is on {initial_state.device} but q is on {q.device}")
    return B, T, H, HV, K, V, N


def offsets_on(cu_seqlens, device):
    """``cu_seqlens`` on ``device`` (a CPU tensor is copied once, asynchronously from the host's view)."""
    if cu_seqlens is None:
        return None
    return cu_seqlens if cu_seqlens.device == device else cu_seqlens.to(device, non_blocking=True)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                                     cu_seqlens=None, use_qk_l2norm=False):
    """Gated delta rule by the fused recurrent kernel: decode and short prefills, inference only.

    Contract of :func:`gdn.ops.gated_delta_rule`:

    Args:
        q, k: [B, T, H, K] (float32 / float16 / bfloat16).
        v: [B, T, HV, V], HV a multiple of H (value head j reads q/k head ``j // (HV // H)``).
        g: [B, T, HV] log decay, or None (no gate). beta: [B, T, HV], or None (no delta term:
            ``S += k v^T``).
        scale: query scale, default ``K ** -0.5``.
        initial_state: [N, HV, K, V] (cast to float32), or None for zeros.
        output_final_state: also return the final state [N, HV, K, V] float32.
        cu_seqlens: [N + 1] offsets of sequences packed along T (B == 1). On the GPU it is used as
            is (no host sync; its values are then not checked); on the CPU it is validated and copied.
        use_qk_l2norm: L2-normalise q and k over K inside the kernel (eps: :data:`gdn.ops.gates.L2NORM_EPS`).

    Returns:
        ``(o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] float32 or None)``.

    Cost: the state is read once and written once per call, T sequential steps per program, so it
    is meant for small T (decode, speculative steps, short prefills); long sequences belong to the
    chunked kernels. Raises ValueError if grad mode is on and an input requires grad.
    """
    B, T, H, HV, K, V, N = check_kernel_inputs(q, k, v, g, beta, scale, cu_seqlens, initial_state)
    check_no_grad("fused_recurrent_gated_delta_rule", q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    scale = K ** -0.5 if scale is None else scale
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(torch.float32).contiguous()
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=v.device) if output_final_state else None
    launch(contiguous_last(q), contiguous_last(k), contiguous_last(v), g, beta, o, h0, ht, scale=scale,
           cu_seqlens=offsets_on(cu_seqlens, q.device), store_ht=output_final_state,
           use_qk_l2norm=use_qk_l2norm, num_sequences=N)
    return o, ht


def fused_recurrent_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm=False):
    """DeltaNet (no gate) by the fused recurrent kernel. Shapes as in :func:`fused_recurrent_gated_delta_rule`."""
    return fused_recurrent_gated_delta_rule(q, k, v, None, beta, scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                            use_qk_l2norm=use_qk_l2norm)


def fused_recurrent_gated_linear_attention(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False,
                                           cu_seqlens=None, use_qk_l2norm=False):
    """Gated linear attention (scalar decay, no delta term). Shapes as in :func:`fused_recurrent_gated_delta_rule`."""
    return fused_recurrent_gated_delta_rule(q, k, v, g, None, scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                            use_qk_l2norm=use_qk_l2norm)


def fused_recurrent_linear_attention(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                                     cu_seqlens=None, use_qk_l2norm=False):
    """Linear attention (``S += k v^T``). Shapes as in :func:`fused_recurrent_gated_delta_rule`."""
    return fused_recurrent_gated_delta_rule(q, k, v, None, None, scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                            use_qk_l2norm=use_qk_l2norm)
