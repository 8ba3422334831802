"""The four recurrent members on the chunk kernels, wrapped in ``torch.autograd.Function``.

Same contract as :mod:`gdn.ops.reference` (arguments already validated by :mod:`gdn.ops`):
q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state [N, HV, K, V];
cu_seqlens [N + 1] (B == 1). Returns ``(o [B, T, HV, V] in v.dtype, final state [N, HV, K, V]
fp32 or None)``. Gradients flow to q, k, v, g, beta and initial_state, and from the final state.
Inputs may be fp32, fp16 or bf16 (fp64 is computed in fp32; mixed q/k/v dtypes are promoted to
one); intermediates are kept in that dtype, the running and final states and accumulation in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import chunk_bwd, chunk_fwd
from ._common import Chunks, make_chunks, pow2, precompile

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _kernel_dtype(*xs) -> torch.dtype:
    dt = xs[0].dtype
    for x in xs[1:]:
        dt = torch.promote_types(dt, x.dtype)
    return dt if dt in _KERNEL_DTYPES else torch.float32


class ChunkFunction(torch.autograd.Function):
    """Autograd node of one chunk-kernel call. Saves only the inputs; the backward recomputes the
    per-chunk states (one forward state pass) instead of keeping them.

    K and V that are not powers of two (60, 100) are zero-padded to the next one (≥ 16) on the way
    in and cut back on the way out: zero key/query columns and zero value columns change no result,
    and the kernels then never mask a feature dimension (on the H200, masked odd feature tiles in
    bf16 triggered an illegal memory access inside Triton-generated code)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale: float, want_final: bool, ch: Chunks):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        io = _kernel_dtype(q, k, v)  # one dtype for q, k, v and the intermediates
        qp = q.reshape(B * T, H, K).to(io).contiguous()
        kp = k.reshape(B * T, H, K).to(io).contiguous()
        vp = v.reshape(B * T, HV, V).to(io).contiguous()
        gp = None if g is None else g.reshape(B * T, HV).float().contiguous()
        bp = None if beta is None else beta.reshape(B * T, HV).float().contiguous()
        h0p = None if h0 is None else h0.float().contiguous()
        Kp, Vp = pow2(K), pow2(V)
        if Kp != K:
            qp, kp = F.pad(qp, (0, Kp - K)), F.pad(kp, (0, Kp - K))
        if Vp != V:
            vp = F.pad(vp, (0, Vp - V))
        if h0p is not None and (Kp, Vp) != (K, V):
            h0p = F.pad(h0p, (0, Vp - V, 0, Kp - K))
        if qp.is_cuda:  # first call of this kind: compile the forward and backward kernels in parallel
            def dry_run():  # the launches of one forward + backward, recorded by precompile, not run
                dht = torch.empty(ch.N, HV, Kp, Vp, device=qp.device) if want_final else None
                hh, vn, _, _, _ = chunk_fwd.forward_intermediates(qp, kp, vp, gp, bp, h0p, ch, want_final)
                chunk_fwd.output(qp, kp, vp, gp, hh, vn, ch, scale, io)
                chunk_bwd.backward(qp, kp, vp, gp, bp, h0p, vp, dht, ch, scale)

            precompile((Kp, Vp, io, gp is None, bp is None, h0p is None, want_final, qp.device, H, HV), dry_run)
        h, VN, ht, _, _ = chunk_fwd.forward_intermediates(qp, kp, vp, gp, bp, h0p, ch, want_final)
        o = chunk_fwd.output(qp, kp, vp, gp, h, VN, ch, scale, io)[..., :V]
        if ht is not None and (Kp, Vp) != (K, V):
            ht = ht[..., :K, :V].contiguous()
        ctx.save_for_backward(qp, kp, vp, gp, bp, h0p)
        ctx.meta = (B, T, H, HV, K, V, scale, ch, q.dtype, k.dtype, v.dtype,
                    None if g is None else g.dtype, None if beta is None else beta.dtype,
                    None if h0 is None else h0.dtype)
        o = o.reshape(B, T, HV, V).to(v.dtype)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        qp, kp, vp, gp, bp, h0p = ctx.saved_tensors
        B, T, H, HV, K, V, scale, ch, q_dt, k_dt, v_dt, g_dt, b_dt, h0_dt = ctx.meta
        Kp, Vp = kp.shape[-1], vp.shape[-1]
        dop = do.reshape(B * T, HV, V).to(vp.dtype)
        dop = (F.pad(dop, (0, Vp - V)) if Vp != V else dop).contiguous()
        dhtp = None if dht is None else dht.float()
        if dhtp is not None and (Kp, Vp) != (K, V):
            dhtp = F.pad(dhtp, (0, Vp - V, 0, Kp - K))
        dhtp = None if dhtp is None else dhtp.contiguous()
        DQ, DK, DV, DG, DB, dh0 = chunk_bwd.backward(qp, kp, vp, gp, bp, h0p, dop, dhtp, ch, scale)
        G = HV // H
        if G == 1:  # no group to sum over
            dq = DQ[..., :K].reshape(B, T, H, K).to(q_dt)
            dk = DK[..., :K].reshape(B, T, H, K).to(k_dt)
        else:
            dq = DQ.view(B, T, H, G, Kp)[..., :K].sum(3).to(q_dt)
            dk = DK.view(B, T, H, G, Kp)[..., :K].sum(3).to(k_dt)
        dv = DV[..., :V].reshape(B, T, HV, V).to(v_dt)
        dg = None if DG is None else DG.view(B, T, HV).to(g_dt)
        db = None if DB is None else DB.view(B, T, HV).to(b_dt)
        dh0 = None if dh0 is None else dh0[..., :K, :V].to(h0_dt)
        return dq, dk, dv, dg, db, dh0, None, None, None


def chunk_op(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Run one member (``g``/``beta`` None for what it lacks) on the chunk kernels."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else float(scale)
    ch = make_chunks(B, T, cu_seqlens, q.device)
    o, ht = ChunkFunction.apply(q, k, v, g, beta, initial_state, scale, bool(output_final_state), ch)
    return o, (ht if output_final_state else None)
