"""Kimi Delta Attention on the GPU: token-recurrent Triton kernels, forward (decode included) and backward.

One program owns one (sequence, value head, V-tile) and walks the tokens with its ``[K, BV]`` slice
of the fp32 state in registers. Columns of the state are independent under the update (``Sᵀk``
and ``Sᵀq`` reduce over K), so tiling V is exact. Per token::

    A   = diag(exp g_t) S              (per key channel)
    e   = v_t − Aᵀ k_t
    S   = A + β_t k_t eᵀ
    o_t = scale · Sᵀ q_t

Backward walks the tokens in reverse. The state before token t is needed there, so the forward
pass checkpoints the state every ``CK`` tokens (:mod:`gdn.ops.tuning`); the backward recomputes the ``CK`` states of
one stretch from its checkpoint into a scratch buffer, then runs the adjoint of the step over
them (``dS`` carried in registers)::

    dS += scale q doᵀ;  dq = scale S do
    dβ = kᵀ dS e;  dk = β dS e − A de;  de = β dSᵀ k;  dv = de
    dA = dS − k deᵀ;  dg = exp(g) ⊙ rowsum(dA ⊙ S_prev);  dS_prev = diag(exp g) dA

dq, dk, dg and dβ are reductions over V: each V-tile writes its part, summed on the host (and
over the value heads sharing a q/k head). Inputs are validated by the caller
(:func:`gdn.ops.kda.reference.check_kda`); :mod:`gdn.ops.router` sends decode steps here (and
value heads wider than the chunk kernels take), everything else to :mod:`.chunk`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...router import needs_grad
from ...triton.common import tl_sum
from ...triton.launch import direct
from ...tuning import MAX_HEAD_DIM, OTHER, cdiv, kda_recurrent_tiles


@triton.jit
def _step(b_h, k, v, g, beta, i_t, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
          V: tl.constexpr, o_k, o_v, m_k, m_v):
    """The state [BK, BV] after token i_t: decay each key channel, then the delta rule's write."""
    b_k = tl.load(k + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + (i_t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_g = tl.load(g + (i_t * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + i_t * HV + i_hv).to(tl.float32)
    b_h = b_h * tl.exp(b_g)[:, None]
    b_e = b_v - tl_sum(b_h * b_k[:, None], axis=0)
    return b_h + (b_beta * b_k)[:, None] * b_e[None, :]


@triton.jit
def _kda_fwd_kernel(q, k, v, g, beta, o, h0, ht, ckpt, cu, ck_off, scale,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, CKS: tl.constexpr,
                    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_CKPT: tl.constexpr):
    """Grid ``(cdiv(V, BV), N * HV)``. Tokens are one packed stream; sequence n spans ``cu[n]:cu[n+1]``.
    STORE_CKPT: the state entering tokens ``bos + j·CKS`` goes to ``ckpt[ck_off[n] + j]``."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    o_h = o_k[:, None] * V + o_v[None, :]
    p_state = (i_n * HV + i_hv) * K * V + o_h
    if USE_H0:
        b_h = tl.load(h0 + p_state, mask=m_h, other=0.0).to(tl.float32)
    else:
        b_h = tl.full([BK, BV], 0.0, dtype=tl.float32)
    if STORE_CKPT:
        c0 = tl.load(ck_off + i_n).to(tl.int64)

    i_t = bos
    while i_t < eos:
        if STORE_CKPT:
            if (i_t - bos) % CKS == 0:
                c = c0 + (i_t - bos) // CKS
                tl.store(ckpt + (c * HV + i_hv) * K * V + o_h, b_h, mask=m_h)
        b_q = tl.load(q + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_h = _step(b_h, k, v, g, beta, i_t, i_h, i_hv, H, HV, K, V, o_k, o_v, m_k, m_v)
        b_o = tl_sum(b_h * b_q[:, None], axis=0) * scale
        tl.store(o + (i_t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        i_t += 1
    if STORE_HT:
        tl.store(ht + p_state, b_h, mask=m_h)


@triton.jit
def _kda_bwd_kernel(q, k, v, g, beta, do, dht, ckpt, scratch, cu, ck_off,
                    dq, dk, dv, dg, dbeta, dh0, scale, TT,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, CKS: tl.constexpr,
                    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr):
    """Grid ``(NV, N * HV)``. dq/dk/dg: [NV, TT, HV, K] and dbeta: [NV, TT, HV] per-tile parts;
    dv: [TT, HV, V]; dh0: [N, HV, K, V]; scratch: [NV · N · HV, CKS, BK, BV]."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(ck_off + i_n).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    o_h = o_k[:, None] * V + o_v[None, :]
    o_s = tl.arange(0, BK)[:, None] * BV + tl.arange(0, BV)[None, :]
    p_scr = scratch + (i_v * tl.num_programs(1) + i_nh) * CKS * BK * BV
    p_state = (i_n * HV + i_hv) * K * V + o_h
    if USE_DHT:
        b_dh = tl.load(dht + p_state, mask=m_h, other=0.0).to(tl.float32)
    else:
        b_dh = tl.full([BK, BV], 0.0, dtype=tl.float32)
    part = i_v.to(tl.int64) * TT  # row offset of this tile's partial sums

    n_ck = (eos - bos + CKS - 1) // CKS
    j = n_ck - 1
    while j >= 0:
        start = bos + j * CKS
        end = tl.where(start + CKS < eos, start + CKS, eos)
        # Recompute the states entering tokens start..end-1 from the checkpoint into the scratch.
        b_h = tl.load(ckpt + ((c0 + j) * HV + i_hv) * K * V + o_h, mask=m_h, other=0.0)
        i_t = start
        while i_t < end:
            tl.store(p_scr + (i_t - start) * BK * BV + o_s, b_h)
            b_h = _step(b_h, k, v, g, beta, i_t, i_h, i_hv, H, HV, K, V, o_k, o_v, m_k, m_v)
            i_t += 1
        tl.debug_barrier()
        # Adjoint of each step, last token first.
        i_t = end - 1
        while i_t >= start:
            b_hp = tl.load(p_scr + (i_t - start) * BK * BV + o_s)
            b_q = tl.load(q + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_k = tl.load(k + (i_t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + (i_t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_g = tl.load(g + (i_t * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + i_t * HV + i_hv).to(tl.float32)
            b_do = tl.load(do + (i_t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_a = tl.exp(b_g)
            b_A = b_hp * b_a[:, None]
            b_e = b_v - tl_sum(b_A * b_k[:, None], axis=0)
            b_S = b_A + (b_beta * b_k)[:, None] * b_e[None, :]
            b_dq = tl_sum(b_S * b_do[None, :], axis=1) * scale
            b_dh += (scale * b_q)[:, None] * b_do[None, :]
            b_dSe = tl_sum(b_dh * b_e[None, :], axis=1)  # dS e: [BK]
            b_db = tl_sum(b_dSe * b_k, axis=0)
            b_de = b_beta * tl_sum(b_dh * b_k[:, None], axis=0)  # [BV]
            b_dk = b_beta * b_dSe - tl_sum(b_A * b_de[None, :], axis=1)
            b_dA = b_dh - b_k[:, None] * b_de[None, :]
            b_dg = b_a * tl_sum(b_dA * b_hp, axis=1)
            b_dh = b_dA * b_a[:, None]
            row = (part + i_t) * HV + i_hv
            tl.store(dq + row * K + o_k, b_dq, mask=m_k)
            tl.store(dk + row * K + o_k, b_dk, mask=m_k)
            tl.store(dg + row * K + o_k, b_dg, mask=m_k)
            tl.store(dbeta + row, b_db)
            tl.store(dv + (i_t * HV + i_hv) * V + o_v, b_de.to(dv.dtype.element_ty), mask=m_v)
            i_t -= 1
        tl.debug_barrier()
        j -= 1
    if STORE_DH0:
        tl.store(dh0 + p_state, b_dh, mask=m_h)


def _checkpoints(B: int, T: int, cu_seqlens, device):
    """Packed offsets [N+1] (int32, on device), checkpoint offsets [N] and the checkpoint count.
    Dense calls build both on the device (no host copy: the decode step is captured in CUDA graphs)."""
    ck = OTHER["kda_recurrent"]["CK"]
    if cu_seqlens is None:
        n = -(-T // ck)
        ar = torch.arange(B + 1, device=device, dtype=torch.int32)
        return ar * T, ar[:-1] * n, B * n, B
    host = cu_seqlens.detach().to("cpu", torch.int64)
    n_ck = (host[1:] - host[:-1] + ck - 1) // ck
    off = torch.zeros_like(n_ck)
    off[1:] = torch.cumsum(n_ck, 0)[:-1]
    dev = lambda x: x.to(device=device, dtype=torch.int32)  # noqa: E731
    return dev(host), dev(off), int(n_ck.sum()), host.numel() - 1


def _forward(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, keep_ckpt):
    """Launch the forward kernel; returns o, the final state (or None), the checkpoints (or None), the layout."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cu, ck_off, n_ck, N = _checkpoints(B, T, cu_seqlens, q.device)
    BK, BV = kda_recurrent_tiles(K, V)
    o = torch.empty(B, T, HV, V, dtype=v.dtype, device=v.device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=v.device) if output_final_state else None
    ckpt = torch.empty(max(n_ck, 1), HV, K, V, dtype=torch.float32, device=v.device) if keep_ckpt else None
    grid = (cdiv(V, BV), N * HV)
    direct(_kda_fwd_kernel, grid, q, k, v, g, beta, o, h0 if h0 is not None else o, ht if ht is not None else o,
           ckpt if ckpt is not None else o, cu, ck_off, scale, H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
           CKS=OTHER["kda_recurrent"]["CK"], USE_H0=h0 is not None, STORE_HT=ht is not None,
           STORE_CKPT=ckpt is not None)
    return o, ht, ckpt, (cu, ck_off, N)


class _KDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        h0c = h0.float().contiguous() if h0 is not None else None
        o, ht, ckpt, layout = _forward(q, k, v, g, beta, scale, h0c, output_final_state, cu_seqlens, True)
        ctx.save_for_backward(q, k, v, g, beta, ckpt)
        ctx.layout, ctx.scale = layout, scale
        ctx.has_h0, ctx.h0_dtype = h0 is not None, (h0.dtype if h0 is not None else None)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, ckpt = ctx.saved_tensors
        cu, ck_off, N = ctx.layout
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        BK, BV = kda_recurrent_tiles(K, V)
        NV, TT = cdiv(V, BV), B * T
        f32 = dict(dtype=torch.float32, device=q.device)
        dq = torch.empty(NV, TT, HV, K, **f32)
        dk = torch.empty(NV, TT, HV, K, **f32)
        dg = torch.empty(NV, TT, HV, K, **f32)
        db = torch.empty(NV, TT, HV, **f32)
        dv = torch.empty(B, T, HV, V, dtype=torch.float32, device=q.device)
        dh0 = torch.empty(N, HV, K, V, **f32) if ctx.has_h0 else None
        scratch = torch.empty(NV * N * HV, OTHER["kda_recurrent"]["CK"], BK, BV, **f32)
        direct(_kda_bwd_kernel, (NV, N * HV),
               q, k, v, g, beta, do.contiguous(), dht.contiguous() if dht is not None else dq, ckpt, scratch, cu,
               ck_off, dq, dk, dv, dg, db, dh0 if dh0 is not None else dq, ctx.scale, TT, H=H, HV=HV, K=K, V=V,
               BK=BK, BV=BV, CKS=OTHER["kda_recurrent"]["CK"], USE_DHT=dht is not None, STORE_DH0=dh0 is not None)
        m = HV // H
        dq = dq.sum(0).view(B, T, H, m, K).sum(3)
        dk = dk.sum(0).view(B, T, H, m, K).sum(3)
        dg = dg.sum(0).view(B, T, HV, K)
        db = db.sum(0).view(B, T, HV)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype),
                dh0.to(ctx.h0_dtype) if dh0 is not None else None, None, None, None)


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None):
    """KDA on the token-recurrent kernels (shapes of :func:`gdn.ops.kimi_delta_attention`;
    inputs validated).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV]; initial_state:
    [N, HV, K, V]; cu_seqlens: [N + 1] (B == 1). Returns ``(o [B, T, HV, V] in v.dtype, final state
    fp32 or None)``. Differentiable in q, k, v, g, beta and initial_state; without gradients (decode)
    the forward kernel runs alone, with no checkpoints.
    """
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"the Triton KDA kernels hold K <= {MAX_HEAD_DIM}, got K = {q.shape[-1]}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if needs_grad(q, k, v, g, beta, initial_state):
        return _KDAFunction.apply(q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    o, ht, _, _ = _forward(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, False)
    return o, ht
