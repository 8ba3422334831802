"""Kimi Delta Attention on the chunk kernels (:mod:`.chunk_fwd`, :mod:`.chunk_bwd`), with autograd.

Same contract as :func:`gdn.ops.kimi_delta_attention` (arguments validated by the
caller): q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; initial_state
[N, HV, K, V]; cu_seqlens [N + 1] (B == 1). Returns ``(o [B, T, HV, V] in v.dtype, final state
[N, HV, K, V] fp32 or None)``. Gradients flow to q, k, v, g, beta and initial_state, through o
and the final state. q, k, v may be fp32, fp16 or bf16 (fp64 and mixed dtypes are computed in
the promoted kernel dtype, fp32 for fp64); g, beta and the states are used in fp32.

K and V that are not powers of two ≥ ``MIN_DIM`` are zero-padded to the next one (at least 32) on
the way in and cut back on the way out: zero key, query and gate columns and zero value columns
change no result. 32, not 16: no kernel then takes a K or V tile 16 wide (triton 3.6 on the H200
miscompiled such dots in the scalar kernels, docs/TRITON.md); the 16-row sub-blocks of kkt and
intra_bwd are the only 16-wide dots left.
"""
from __future__ import annotations

import torch

from ...triton.common import Chunks, group_sum, kernel_dtype, make_chunks, pad_zeros, pow2
from ...triton.launch import precompile
from ...tuning import MAX_HEAD_DIM, MIN_DIM
from . import chunk_bwd, chunk_fwd


def dry_run(q, k, v, g, beta, h0, ch: Chunks, want_final: bool, scale: float, grad_dtype=torch.float32,
            dv_dtype=None) -> None:
    """Every launch of one forward + backward on padded, packed inputs (q, k [T, H, K]; v [T, HV, V];
    g [T, HV, K]; beta [T, HV]; h0 [N, HV, K, V] or None), for :func:`gdn.ops.triton.launch.precompile` to
    record (outputs are uninitialised buffers)."""
    HV, K, V = v.shape[1], k.shape[2], v.shape[2]
    dht = torch.empty(ch.N, HV, K, V, device=v.device) if want_final else None
    G = chunk_fwd.gamma(g, ch)
    fw = chunk_fwd.forward_intermediates(q, k, v, G, beta, h0, ch, want_final, scale)
    chunk_fwd.output(fw, ch, scale, v.dtype)
    chunk_bwd.backward(q, k, v, G, beta, h0, v, dht, ch, scale, (fw.Ai, fw.P), grad_dtype, dv_dtype)


class KDAChunkFunction(torch.autograd.Function):
    """Autograd node of one chunk KDA call. Saves the (padded) inputs, γ and the in-chunk inverse
    T⁻¹ and pair matrix P ([T, HV, 64] each, input dtype: 256 bytes per token and value head at
    bf16; recomputing them cost the backward its second most expensive kernel); the backward
    recomputes the rest of the per-chunk intermediates and the states instead of keeping them."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale: float, want_final: bool, ch: Chunks):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        io = kernel_dtype(q, k, v)
        Kp, Vp = pow2(K, MIN_DIM), pow2(V, MIN_DIM)
        qp = pad_zeros(q.reshape(B * T, H, K).to(io), 0, Kp - K)
        kp = pad_zeros(k.reshape(B * T, H, K).to(io), 0, Kp - K)
        vp = pad_zeros(v.reshape(B * T, HV, V).to(io), 0, Vp - V)
        gp = pad_zeros(g.reshape(B * T, HV, K).float(), 0, Kp - K)
        bp = beta.reshape(B * T, HV).float().contiguous()
        h0p = pad_zeros(None if h0 is None else h0.float(), 0, Vp - V, 0, Kp - K)
        # dq, dk, dv in the inputs' dtype when they are in it: dq and dk per value head too, each
        # group's summed in fp32 (group_sum) and rounded once more, as the gated delta rule's
        gdt = io if q.dtype == k.dtype == v.dtype == io else torch.float32
        vdt = io if v.dtype == io else torch.float32  # dv is never summed over a group
        if qp.is_cuda:  # first call of this kind: compile the forward and backward kernels in parallel
            precompile(("kda", Kp, Vp, io, h0p is None, want_final, qp.device, H, HV, gdt, vdt),
                       lambda: dry_run(qp, kp, vp, gp, bp, h0p, ch, want_final, scale, gdt, vdt))
        G = chunk_fwd.gamma(gp, ch)
        fw = chunk_fwd.forward_intermediates(qp, kp, vp, G, bp, h0p, ch, want_final, scale)
        o, ht = chunk_fwd.output(fw, ch, scale, io)[..., :V], fw.ht
        Ai, P = fw.Ai, fw.P
        del fw
        if ht is not None and (Kp, Vp) != (K, V):
            ht = ht[..., :K, :V].contiguous()
        ctx.save_for_backward(qp, kp, vp, G, bp, h0p, Ai, P)
        ctx.meta = (B, T, H, HV, K, V, scale, ch, gdt, vdt, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
                    None if h0 is None else h0.dtype)
        return o.reshape(B, T, HV, V).to(v.dtype), ht

    @staticmethod
    def backward(ctx, do, dht):
        qp, kp, vp, G, bp, h0p, Ai, P = ctx.saved_tensors
        B, T, H, HV, K, V, scale, ch, gdt, vdt, q_dt, k_dt, v_dt, g_dt, b_dt, h0_dt = ctx.meta
        Kp, Vp = kp.shape[-1], vp.shape[-1]
        dop = pad_zeros(do.reshape(B * T, HV, V).to(vp.dtype), 0, Vp - V)
        dhtp = pad_zeros(None if dht is None else dht.float(), 0, Vp - V, 0, Kp - K)
        DQ, DK, DV, DG, DB, dh0 = chunk_bwd.backward(qp, kp, vp, G, bp, h0p, dop, dhtp, ch, scale, (Ai, P), gdt, vdt)
        dq = group_sum(DQ.view(B, T, H, HV // H, Kp), K, q_dt)  # summed over each key head's value heads
        dk = group_sum(DK.view(B, T, H, HV // H, Kp), K, k_dt)
        dv = DV[..., :V].reshape(B, T, HV, V).to(v_dt)
        dg = DG[..., :K].reshape(B, T, HV, K).to(g_dt)
        db = DB.view(B, T, HV).to(b_dt)
        dh0 = None if dh0 is None else dh0[..., :K, :V].to(h0_dt)
        return dq, dk, dv, dg, db, dh0, None, None, None


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Chunkwise KDA on the GPU kernels (shapes in the module docstring; inputs validated).

    Returns ``(o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] fp32 or None)``."""
    B, T, H, K = q.shape
    if max(K, v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"the Triton KDA chunk kernels take K, V <= {MAX_HEAD_DIM}, got K = {K}, V = {v.shape[-1]}")
    scale = K ** -0.5 if scale is None else float(scale)
    ch = make_chunks(B, T, cu_seqlens, q.device)
    o, ht = KDAChunkFunction.apply(q, k, v, g, beta, initial_state, scale, bool(output_final_state), ch)
    return o, (ht if output_final_state else None)
