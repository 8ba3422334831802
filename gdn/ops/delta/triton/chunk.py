"""The four recurrent members on the chunk kernels, wrapped in ``torch.autograd.Function``.

Same contract as :mod:`gdn.ops.delta.reference` (arguments already validated by :mod:`gdn.ops`):
q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; initial_state [N, HV, K, V];
cu_seqlens [N + 1] (B == 1). Returns ``(o [B, T, HV, V] in v.dtype, final state [N, HV, K, V]
fp32 or None)``. Gradients flow to q, k, v, g, beta and initial_state, and from the final state.
Inputs may be fp32, fp16 or bf16 (fp64 is computed in fp32; mixed q/k/v dtypes are promoted to
one); intermediates are kept in that dtype, the running and final states and accumulation in fp32.
"""
from __future__ import annotations

import torch

from . import chunk_bwd, chunk_fwd, split as split_mod
from ...triton.common import Chunks, cast, group_sum, kernel_dtype, make_chunks, pad_zeros, pow2, sm_count
from ...triton.launch import precompile
from ...router import needs_grad
from ... import tuning
from ...tuning import DELTA, MIN_DIM


def _forward(q, k, v, g, beta, h0, ch, want_final, scale, io, fused=None, ws=None, plans=None):
    """(o, final state, Ai, γ): the fused forward pass when its (sequence, head, value tile) programs
    still running at the end of the pass (``Chunks.long_sequences``; a packed batch's short sequences
    finish early and leave the longest one's programs alone on the card) number at least
    ``DELTA["state_out"]["fill"]`` (1.5) times the card's multiprocessors, else the
    state pass storing h and δ followed by the fully parallel output kernel. The fused pass's chunk
    step is longer; with few programs nothing hides it. Measured on the H200 (132 SMs; GPU µs of the
    pass(es), `ops_gpu.py --variants --profile`): 4 × 8192 (256 programs) 507 fused against 296 + 283;
    grouped 1 × 8192, HV = 32 (128) 444 against 224 + 128; 1 × 32768 (64) 1669 against 830 + 284;
    packed, 12 sequences of 64-7000 tokens (one long): forward 1.63 ms fused against 1.31."""
    if fused is None:  # (the caller passes layout()'s decision, and ws, when it has made them already)
        K, V = k.shape[-1], v.shape[2]
        ws = chunk_fwd.warp_specialised(q, g, beta, K, V)
        fused = layout(ch, v.shape[1], K, V, v.device, g is not None, ws)[0]
    if fused:
        return chunk_fwd.forward(q, k, v, g, beta, h0, ch, want_final, scale, io, ws, plans)
    h, VN, ht, Ai, _, G = chunk_fwd.forward_intermediates(q, k, v, g, beta, h0, ch, want_final,
                                                          from_inverse=DELTA["state_fwd"].get("from_inverse", False),
                                                          plans=plans)
    return chunk_fwd.output(q, k, v, g, h, VN, ch, scale, io), ht, Ai, G


def layout(ch: Chunks, HV: int, K: int, V: int, device, gated: bool = False, ws: bool = False) -> tuple:
    """(fused forward?, value tiles of state_out, state_fwd, state_bwd, warm split?) of a call: what decides
    which kernels and tile widths it compiles (part of the parallel first-call compile's key, so a
    new shape that needs other tiles compiles them in parallel too). ``ws``: the warp-specialised
    forward pass takes the call (chunk_fwd.warp_specialised), which is always the fused forward
    (it splits the sequences itself where they would leave the card idle)."""
    tiles = tuple(chunk_fwd.state_tile(n, ch, HV, K, V, device)[1] for n in ("state_out", "state_fwd", "state_bwd"))
    # value heads narrower than 64 always take the fused pass: triton 3.6 on the H200 compiles the
    # output kernel wrong for bf16 value tiles of 16 and 32 (tests/gpu at T = 63, V = 16
    # padded to 32: o off by 180 %, everything else right; the fused pass is right there)
    # and the fused pass runs only at value tiles of at least BV_min: its narrower tiles (16 at
    # K = 256) were never right on the H200 (the one case run, (8, 2048, 16, 256) bf16, faulted),
    # while the two-stage pair is what the backward recomputes at every K anyway
    # A gated member whose sequences leave the card idle splits them into warm-started segments
    # (split.split_len), which fill it: with DELTA["split"]["fused"] the fused pass runs on
    # the segments, else the two-stage forward's state pass does.
    c = DELTA["state_out"]
    fills = ch.long_sequences * HV * -(-V // tiles[0]) >= c["fill"] * sm_count(device)
    split = (gated and DELTA["split"]["warm"] and DELTA["split"]["fused"]
             and split_mod.split_len(ch, HV, -(-V // tiles[0]), device) > 0)
    fused = ws or V < 64 or (tiles[0] >= c["BV_min"] and (fills or split))
    return (fused,) + tiles + (split,)


def _decisions(ch: Chunks, qp, gp, bp, h0p, H: int, HV: int, Kp: int, Vp: int, want_final: bool, gdt, vdt) -> tuple:
    """(warp-specialised forward?, :func:`layout`, the first-call compile's key) of a call, worked
    out once per chunk layout, shapes, dtypes, device, launch tables (tuning.token) and what the
    device rules say (whether the warp-specialised pass takes the call, the multiprocessors: asked
    at every call, so that they are the rules' answers, as tests that stand in a Hopper card for
    the CPU see them) and kept in the layout's memo: a call at a shape seen before takes the rest
    from there (each is a dozen small rules, and the call's host time is what a small shape waits
    on)."""
    io, dev, gated = qp.dtype, qp.device, gp is not None
    ws = chunk_fwd.warp_specialised(qp, gp, bp, Kp, Vp)
    key = ("decisions", H, HV, Kp, Vp, io, gated, bp is None, h0p is None, want_final, gdt, vdt, dev, ws,
           sm_count(dev), tuning.token())
    hit = ch.memo.get(key)
    if hit is None:
        lay = layout(ch, HV, Kp, Vp, dev, gated, ws)
        inv = tuple(DELTA[n].get("from_inverse", False) for n in ("state_out", "state_fwd", "state_bwd"))
        split = tuple(sorted(DELTA["split"].items()))
        kind = (Kp, Vp, io, gp is None, bp is None, h0p is None, want_final, dev, H, HV, gdt, vdt, lay, inv, split,
                tuple(bool(DELTA[n]["on"]) for n in ("fused_bwd", "fused_fwd", "fused_states", "fused_rbwd")))
        hit = ch.memo[key] = (ws, lay, kind)
    return hit


class ChunkFunction(torch.autograd.Function):
    """Autograd node of one chunk-kernel call. Saves the inputs and the in-chunk inverse; the
    backward recomputes the per-chunk states (one forward state pass) instead of keeping them,
    with δ formed from the in-chunk inverse as the forward forms it (``DELTA["state_bwd"]
    ["from_inverse"]``: its reverse pass forms Wᵀ dδ from T⁻¹ too, so no W or U is made; without
    it both passes read W and U recomputed by wu, equal up to rounding in the input dtype).

    K and V that are not powers of two (60, 100), or narrower than 32, are zero-padded to the next
    power of two (≥ 32) on the way in and cut back on the way out: zero key/query columns and zero value columns change no result,
    and the kernels never mask a feature dimension (one mechanism for every size instead of masked
    tails in every load and store)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale: float, want_final: bool, ch: Chunks):
        return _chunk_forward(ctx, q, k, v, g, beta, h0, scale, want_final, ch)

    @staticmethod
    def backward(ctx, do, dht):
        return _chunk_backward(ctx, do, dht)


def _chunk_forward(ctx, q, k, v, g, beta, h0, scale: float, want_final: bool, ch: Chunks):
    """(o, final state or None) of :class:`ChunkFunction`'s forward; what the backward needs goes
    on ``ctx``, unless it is None (a call no gradient will flow through: no autograd node)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    io = kernel_dtype(q, k, v)  # one dtype for q, k, v and the intermediates
    qp, kp, vp = cast(q.reshape(B * T, H, K), io), cast(k.reshape(B * T, H, K), io), cast(v.reshape(B * T, HV, V), io)
    gp = None if g is None else cast(g.reshape(B * T, HV), torch.float32).contiguous()
    bp = None if beta is None else cast(beta.reshape(B * T, HV), torch.float32).contiguous()
    Kp, Vp = max(MIN_DIM, pow2(K)), max(MIN_DIM, pow2(V))
    qp, kp, vp = pad_zeros(qp, 0, Kp - K), pad_zeros(kp, 0, Kp - K), pad_zeros(vp, 0, Vp - V)
    h0p = pad_zeros(None if h0 is None else cast(h0, torch.float32), 0, Vp - V, 0, Kp - K)
    # dq, dk, dv in the inputs' dtype when they are in it: dq and dk per value head too, each
    # group's summed here in fp32 (group_sum) and rounded once more. fp32 partials would double
    # the backward's largest buffers for grouped heads (Qwen3.5-397B, 64 value heads of 128:
    # 2 GiB instead of 1) to save one rounding of each partial, of the size of the output's own
    # rounding to its dtype
    gdt = io if q.dtype == k.dtype == v.dtype == io else torch.float32
    vdt = io if v.dtype == io else torch.float32
    ws, lay, kind = _decisions(ch, qp, gp, bp, h0p, H, HV, Kp, Vp, want_final, gdt, vdt)
    if qp.is_cuda:  # first call of this kind: compile the forward and backward kernels in parallel
        def dry_run():  # the launches of one forward + backward, recorded by precompile, not run
            dht = torch.empty(ch.N, HV, Kp, Vp, device=qp.device) if want_final else None
            pl = {}  # (as a call with autograd hands them on: no launch that such a call does not make)
            _, _, ai, gam = _forward(qp, kp, vp, gp, bp, h0p, ch, want_final, scale, io, lay[0], ws, pl)
            chunk_bwd.backward(qp, kp, vp, gp, bp, h0p, vp, dht, ch, scale, ai, gdt, gam, vdt, pl)

        precompile(kind, dry_run)
    # the in-chunk inverse Ai [T, HV, 64] is kept for the backward (as small as a 64-wide value
    # tensor, and its kernel is the forward's costliest after the state pass); h and δ are not.
    # So are the warm-started split's chunk bounds (kkt_solve's) and warm-up counts, made by the
    # forward and read again by the backward's passes (the same k, β and γ: the same counts),
    # instead of formed twice
    plans = {} if ctx is not None else None
    o, ht, Ai, G = _forward(qp, kp, vp, gp, bp, h0p, ch, want_final, scale, io, lay[0], ws, plans)
    o = o if Vp == V else o[..., :V]
    if ht is not None and (Kp, Vp) != (K, V):
        ht = ht[..., :K, :V].contiguous()
    if ctx is not None:
        ctx.save_for_backward(qp, kp, vp, gp, bp, h0p, Ai, G)
        ctx.plans = plans
        ctx.meta = (B, T, H, HV, K, V, scale, ch, gdt, vdt, q.dtype, k.dtype, v.dtype,
                    None if g is None else g.dtype, None if beta is None else beta.dtype,
                    None if h0 is None else h0.dtype)
    o = cast(o.reshape(B, T, HV, V), v.dtype)
    return o, ht


def _chunk_backward(ctx, do, dht):
    """The gradients of :class:`ChunkFunction`'s inputs."""
    qp, kp, vp, gp, bp, h0p, Ai, G = ctx.saved_tensors
    B, T, H, HV, K, V, scale, ch, gdt, vdt, q_dt, k_dt, v_dt, g_dt, b_dt, h0_dt = ctx.meta
    Kp, Vp = kp.shape[-1], vp.shape[-1]
    dop = pad_zeros(cast(do.reshape(B * T, HV, V), vp.dtype), 0, Vp - V)
    dhtp = pad_zeros(None if dht is None else cast(dht, torch.float32), 0, Vp - V, 0, Kp - K)
    DQ, DK, DV, DG, DB, dh0 = chunk_bwd.backward(qp, kp, vp, gp, bp, h0p, dop, dhtp, ch, scale, Ai, gdt, G, vdt,
                                                 ctx.plans)
    dq = group_sum(DQ.view(B, T, H, HV // H, Kp), K, q_dt)  # summed over each key head's value heads
    dk = group_sum(DK.view(B, T, H, HV // H, Kp), K, k_dt)
    dv = cast((DV if Vp == V else DV[..., :V]).reshape(B, T, HV, V), v_dt)
    dg = None if DG is None else cast(DG.view(B, T, HV), g_dt)
    db = None if DB is None else cast(DB.view(B, T, HV), b_dt)
    dh0 = None if dh0 is None else dh0[..., :K, :V].to(h0_dt)
    return dq, dk, dv, dg, db, dh0, None, None, None


def chunk_op(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Run one member (``g``/``beta`` None for what it lacks) on the chunk kernels."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else float(scale)
    ch = make_chunks(B, T, cu_seqlens, q.device)
    args = (q, k, v, g, beta, initial_state, scale, bool(output_final_state), ch)
    # no autograd node where no gradient will flow (inference): Function.apply's own host time is
    # about a tenth of a small call's
    o, ht = ChunkFunction.apply(*args) if needs_grad(q, k, v, g, beta, initial_state) else _chunk_forward(None, *args)
    return o, (ht if output_final_state else None)
