"""The backward of the gated delta rule after its recomputed state pass as one warp-specialised
Gluon kernel (``DELTA["fused_rbwd"]``): the reverse pass (:mod:`.fused_rev`) and the per-chunk
gradients (:mod:`.fused_bwd`) in one program per (sequence or warm-started segment, value head),
for 16-bit inputs at K = V = 128 on compute capability 9. Each chunk's gradients are formed as soon
as the state gradient leaving it exists, so the per-chunk dS (dh) and dδ never go to memory and the
pass reads q, k, dO, T⁻¹, δ, v and h (all by tensor copies) and writes dQ, dK (per value head), dV, dβ, dg and dh0.

Per chunk, walked last first (dS = dS_out, the gradient of the state leaving the chunk; S = h, the
state entering it; Γ = exp(γ), γ the in-chunk cumulative log decay; D_rc = exp(γ_r − γ_c) for
r ≥ c; T the in-chunk inverse)::

    Pᵀ = K Qᵀ ⊙ Dᵀ,  L = scale · Pᵀ dO,  dÕ = diag(scale · Γ) dO
    dδ = diag(Γ_C / Γ) K dS + L,  Y = Tᵀ dδ,  Z = −diag(βΓ) Y,  dV = diag(β) Y
    dS_in = Γ_C dS + Qᵀ dÕ + Kᵀ Z                                           (the chain)
    dQ = (dO δᵀ ⊙ D · scale) K + diag(scale · Γ) dO Sᵀ
    dK = (dO δᵀ ⊙ D · scale)ᵀ Q + diag(Γ_C / Γ) δ dSᵀ + diag(βΓ) Tᵀ dW + (M + Mᵀ) K,
         dW = −dδ Sᵀ,  M = diag(β) dA,  dA = −(Tᵀ (dδ δᵀ)) ⊙ D strictly below the diagonal
    dβ, dg: fused_bwd's row sums (dg the reverse in-chunk cumsum of dγ)

with fused_rev's arithmetic for the chain and fused_bwd's for the gradients (dδ δᵀ in two 16-bit
parts for dA). Four roles run side by side in one program, handing tiles through shared memory and
mbarriers (a consumer waits for phase j of a tile's *ready* barrier before it arrives at phase j of
its *free* one, so no role can complete a phase twice by running a chunk ahead):

- the chain (the default partition, one warpgroup) holds dS [K, V] in fp32 registers; per chunk it
  publishes dS in 16 bits, then adds Qᵀ dÕ and Kᵀ Z onto Γ_C dS;
- A (one warpgroup): Pᵀ, L and dÕ for the chain, then (on the segment's own chunks) dO δᵀ, the
  decayed pair terms, dQ in two halves of K and δ dSᵀ, and once B hands over M and dW, dK in two
  halves of K; hands its parts of dγ and dβ to B;
- B (one warpgroup): K dS, dδ (over L's place), Y, Z and dV, then Σ S ⊙ dS, dW, dδ δᵀ's parts,
  Tᵀ (dδ δᵀ), K Kᵀ and M (handed to A), dβ and dg;
- one copy warp brings each chunk's tiles by tensor copies into two slots: dO (and on own chunks h,
  v and δ) into the second once A and B have read the last ones mid-chunk (A after δ dSᵀ, B after
  dδ δᵀ), so that they land during the previous chunk's dA, M and dK; q, k and T⁻¹ into the first
  once each warpgroup has made its last read of them (the chain after its products; B after M, or
  with ``DK_B`` after its terms of dK; A at its chunk's end, or with ``DK_B`` after its products
  through q, before it adds B's terms and stores dK), so that they land during the chunk's tail.

Warm-up chunks (the warm-started split's, walked after a segment's end) run the chain's work only.
Gluon does not run under Triton's interpreter: the GPU tests check the kernel against the two-kernel
path (tests/gpu/test_fused_rbwd.py); the CPU tests compile it for sm_90 and count its resources.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ...triton.common import BT as CHUNK
from ...triton.launch import launch
from ...tuning import DELTA
from .fused_bwd import _tiles, acc_layout, hopper
from .fused_fwd import _edges
from .fused_rev import _span

BT = gl.constexpr(CHUNK)
WG = gl.constexpr(4)  # warps of a warpgroup: each role but the copies'
HK = gl.constexpr(64)  # the halves of K that dQ and dK are formed in

# handshake barriers (index into ``hand``), each with one writer role and its readers
DS_READY, DS_FREE = gl.constexpr(0), gl.constexpr(1)  # dS: chain → A, B
L_READY, DD_FREE = gl.constexpr(2), gl.constexpr(3)  # L (then dδ over it): A → B
O_READY, O_FREE = gl.constexpr(4), gl.constexpr(5)  # dÕ: A → chain
Z_READY, Z_FREE = gl.constexpr(6), gl.constexpr(7)  # Z: B → chain
G_READY, G_FREE = gl.constexpr(8), gl.constexpr(9)  # A's parts of dγ and dβ: A → B
# M and dW (with DK_B: B's terms of dK in dδ's and dÕ's places): B → A, never freed: B writes them
# next after L_READY of the next chunk, which A arrives at only once it is done with these
M_READY = gl.constexpr(10)
P_READY, P_FREE = gl.constexpr(11), gl.constexpr(12)  # (dO δᵀ ⊙ D · scale)ᵀ: A → B (``QK_B`` only)
NHAND = gl.constexpr(13)


@gluon.jit
def _rows(t0, eos, layout: gl.constexpr):
    """(row indices, valid mask) of the chunk's 64 rows in the row layout of ``layout``."""
    rt = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, layout))
    return rt, rt < eos


@gluon.jit
def _at_rows(X, rt, m, HV, i_hv):
    """X[rt, i_hv] of a [T, HV] fp32 tensor (γ or β), zero on rows past the end."""
    return gl.load(X + rt * HV + i_hv, mask=m, other=0.0)


@gluon.jit
def _decay(G, t0, eos, HV, i_hv, layout: gl.constexpr, TRANS: gl.constexpr):
    """D, exp(γ_r − γ_c) where r ≥ c and row r is valid, zero elsewhere, and its strict part's mask
    ([64, 64] in ``layout``); with ``TRANS`` Dᵀ and its mask (the mask of Pᵀ = K Qᵀ, whose columns
    past the end must not reach dO's rows there)."""
    rt, mr = _rows(t0, eos, layout)
    ct = t0 + gl.arange(0, BT, layout=gl.SliceLayout(0, layout))
    g_r = _at_rows(G, rt, mr, HV, i_hv)
    # the columns' γ from the rows' through shared memory, not loaded again: a thread holds 16
    # columns, and where registers are short ptxas consumes each such load as it lands, one L2
    # round trip after another on the path to Pᵀ
    g_c = gl.convert_layout(g_r, gl.SliceLayout(0, layout))
    if TRANS:
        late, early, g_late, g_early = ct[None, :], rt[:, None], g_c[None, :], g_r[:, None]
    else:
        late, early, g_late, g_early = rt[:, None], ct[None, :], g_r[:, None], g_c[None, :]
    keep = (late >= early) & (late < eos)
    return gl.exp(gl.where(keep, g_late - g_early, float("-inf"))), keep & (late != early)


@gluon.jit
def _store_rows(X, x, t0, eos, HV, i_hv, col, W: gl.constexpr, N: gl.constexpr):
    """Columns col … col + N − 1 of the chunk's valid rows of X [T, HV, W] from the [64, N]
    accumulator ``x`` (one warpgroup's), in X's dtype."""
    l_x: gl.constexpr = acc_layout(N, WG)
    rt = t0 + gl.arange(0, BT, layout=gl.SliceLayout(1, l_x))
    o_n = col + gl.arange(0, N, layout=gl.SliceLayout(0, l_x))
    gl.store(X + (rt.to(gl.int64)[:, None] * HV + i_hv) * W + o_n[None, :], x.to(X.dtype.element_ty),
             mask=(rt < eos)[:, None])


@gluon.jit
def _copies(q_t, k_t, do_t, a_t, d_t, h_t, v_t, s_q, s_k, s_do, s_a, s_dl, s_h, s_z, ready, empty, ready2, empty2,
            hand, cu, ends, off, plan, seg_seq, seq_cu, i_n, i_h, i_hv, HV, K: gl.constexpr, V: gl.constexpr,
            WARM: gl.constexpr):
    """The copy warp, chunk nc − 1 − j's tiles in two slots. The second (dO; on the program's own
    chunks h, δ and v, v into Z's buffer once the chain has read the last Z) once A and B have
    released it mid-chunk, so that it lands during the previous chunk; then the first (q, k and
    T⁻¹) once the three warpgroups have released it."""
    main_bytes: gl.constexpr = (2 * BT * K + BT * BT) * 2
    own2_bytes: gl.constexpr = (3 * BT * V + K * V) * 2
    bos, eos, nw, nc = _span(cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, WARM)
    c0 = gl.load(off + i_n)
    for j in range(nc):
        i_c = nc - 1 - j
        t0 = bos + i_c * BT
        own = j >= nw
        mbarrier.wait(empty2, (j & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        if own:
            mbarrier.wait(hand.index(Z_FREE), (j & 1) ^ 1)  # the chain has read the last Z
            mbarrier.expect(ready2, own2_bytes)
            tma.async_copy_global_to_shared(h_t, [((c0 + i_c) * HV + i_hv) * K, 0], ready2, s_h.index(0))
            tma.async_copy_global_to_shared(v_t, [t0, i_hv * V], ready2, s_z.index(0))
            tma.async_copy_global_to_shared(d_t, [t0, i_hv * V], ready2, s_dl.index(0))
        else:
            mbarrier.expect(ready2, BT * V * 2)
        tma.async_copy_global_to_shared(do_t, [t0, i_hv * V], ready2, s_do.index(0))
        mbarrier.wait(empty, (j & 1) ^ 1)
        mbarrier.expect(ready, main_bytes)
        tma.async_copy_global_to_shared(k_t, [t0, i_h * K], ready, s_k.index(0))
        tma.async_copy_global_to_shared(q_t, [t0, i_h * K], ready, s_q.index(0))
        tma.async_copy_global_to_shared(a_t, [t0, i_hv * BT], ready, s_a.index(0))


@gluon.jit
def _chain(u_q, u_k, u_ds, u_o, u_z, ready, empty, hand, G, dht, dh0, cu, ends, plan, seg_seq, seq_cu, i_n, i_hv,
           HV, K: gl.constexpr, V: gl.constexpr, DT: gl.constexpr, USE_DHT: gl.constexpr, USE_INIT: gl.constexpr,
           WARM: gl.constexpr):
    """The chain: dS [K, V] in fp32 registers, from dht where the walk reaches the sequence's end (or
    zero); published in 16 bits per chunk, then Γ_C dS + Qᵀ dÕ + Kᵀ Z; dS_in of the segment that
    starts its sequence to dh0."""
    l_s: gl.constexpr = acc_layout(V, WG)
    bos, eos, nw, nc = _span(cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, WARM)
    i_seq, at_start, at_end = _edges(seg_seq, seq_cu, i_n, bos, eos, WARM)
    o_k = gl.arange(0, K, layout=gl.SliceLayout(1, l_s))
    o_v = gl.arange(0, V, layout=gl.SliceLayout(0, l_s))
    base = (i_seq * HV + i_hv).to(gl.int64) * K * V
    if USE_DHT:
        b_s = gl.load(dht + base + o_k[:, None] * V + o_v[None, :], mask=(o_k < K)[:, None] & at_end, other=0.0)
    else:
        b_s = gl.zeros([K, V], gl.float32, l_s)
    for j in range(nc):
        z = j // nc  # zero, not provably so: the MMA operand descriptors stay in the loop
        s_q = u_q.index(z)
        s_k = u_k.index(z)
        s_ds = u_ds.index(z)
        s_o = u_o.index(z)
        s_z = u_z.index(z)
        par = j & 1
        i_c = nc - 1 - j
        mbarrier.wait(hand.index(DS_FREE), par ^ 1)  # A and B are done with the previous dS
        s_ds.store(b_s.to(DT))
        fence_async_shared()
        mbarrier.arrive(hand.index(DS_READY), count=1)
        last = gl.minimum(eos, bos + (i_c + 1) * BT) - 1
        b_gc = gl.exp(gl.load(G + last * HV + i_hv))
        mbarrier.wait(ready, par)
        mbarrier.wait(hand.index(O_READY), par)
        b_s = warpgroup_mma(s_q.permute((1, 0)), s_o, b_s * b_gc, is_async=True)
        mbarrier.wait(hand.index(Z_READY), par)
        b_s = warpgroup_mma(s_k.permute((1, 0)), s_z, b_s, is_async=True)
        b_s = warpgroup_mma_wait(0, deps=[b_s])
        mbarrier.arrive(hand.index(O_FREE), count=1)
        mbarrier.arrive(hand.index(Z_FREE), count=1)
        mbarrier.arrive(empty, count=1)
    if USE_INIT:
        gl.store(dh0 + base + o_k[:, None] * V + o_v[None, :], b_s, mask=(o_k < K)[:, None] & at_start)


@gluon.jit
def _grad_a(u_q, u_k, u_do, u_dl, u_h, u_ds, u_dd, u_o, u_p, u_a, u_w, u_x, s_g, s_gb, ready, empty, ready2, empty2,
            hand, G, beta, DQ, DK, cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, scale, K: gl.constexpr,
            V: gl.constexpr, DT: gl.constexpr, WARM: gl.constexpr, QK_B: gl.constexpr, DK_B: gl.constexpr):
    """A: Pᵀ, L (into dδ's place) and dÕ for the chain; on own chunks dO δᵀ, the decayed pair terms,
    dQ and δ dSᵀ (then dS and the second slot are free), and once B hands over M and dW, dK in two
    halves of K; its parts of dγ and dβ to B."""
    f32: gl.constexpr = gl.float32
    l_v: gl.constexpr = acc_layout(V, WG)
    l_t: gl.constexpr = acc_layout(BT, WG)
    l_h: gl.constexpr = acc_layout(HK, WG)
    r_t: gl.constexpr = gl.SliceLayout(1, l_t)
    zt = gl.zeros([BT, BT], f32, l_t)
    zh = gl.zeros([BT, HK], f32, l_h)
    zv = gl.zeros([BT, V], f32, l_v)
    bos, eos, nw, nc = _span(cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, WARM)
    for j in range(nc):
        z = j // nc  # zero, not provably so: the MMA operand descriptors stay in the loop
        s_q = u_q.index(z)
        s_k = u_k.index(z)
        s_do = u_do.index(z)
        s_dl = u_dl.index(z)
        s_h = u_h.index(z)
        s_ds = u_ds.index(z)
        s_dd = u_dd.index(z)
        s_o = u_o.index(z)
        s_p = u_p.index(z)
        s_a = u_a.index(z)
        s_w = u_w.index(z)
        s_x = u_x.index(z)
        par = j & 1
        t0 = bos + (nc - 1 - j) * BT
        mbarrier.wait(ready, par)
        # Pᵀ = K Qᵀ ⊙ Dᵀ (columns past the end zeroed), then L and dÕ
        b_p = warpgroup_mma(s_k, s_q.permute((1, 0)), zt, use_acc=False)
        dec_t, s_unused = _decay(G, t0, eos, HV, i_hv, l_t, True)
        if QK_B:
            mbarrier.wait(hand.index(P_FREE), par ^ 1)  # B has read the previous chunk's pair terms
        s_p.store((b_p * dec_t).to(DT))
        fence_async_shared()
        mbarrier.wait(ready2, par)  # dO (and on own chunks h, v and δ)
        b_l = warpgroup_mma(s_p, s_do, zv, use_acc=False)
        mbarrier.wait(hand.index(DD_FREE), par ^ 1)  # B is done with the previous dδ
        s_dd.store((b_l * scale).to(DT))
        fence_async_shared()
        mbarrier.arrive(hand.index(L_READY), count=1)
        rv, mv = _rows(t0, eos, l_v)
        g_v = _at_rows(G, rv, mv, HV, i_hv)
        b_o = s_do.load(l_v).to(f32) * gl.where(mv, scale * gl.exp(g_v), 0.0)[:, None]
        mbarrier.wait(hand.index(O_FREE), par ^ 1)  # the chain's previous update has read dÕ
        s_o.store(b_o.to(DT))
        fence_async_shared()
        mbarrier.arrive(hand.index(O_READY), count=1)
        mbarrier.wait(hand.index(DS_READY), par)
        mbarrier.wait(hand.index(G_FREE), par ^ 1)  # B has read the previous chunk's parts of dγ and dβ
        if j >= nw:
            # dO δᵀ ⊙ D · scale; its pair terms with Q Kᵀ (dγ's); dQ, A's last read of dO and h
            b_e = warpgroup_mma(s_do, s_dl.permute((1, 0)), zt, use_acc=False)
            dec, s_unused = _decay(G, t0, eos, HV, i_hv, l_t, False)
            dsm = b_e * dec * scale
            s_p.store(gl.permute(dsm.to(DT), (1, 0)))  # (dO δᵀ ⊙ D)ᵀ: A operand of dK's term, Bᵀ of dQ's
            fence_async_shared()
            if QK_B:  # B forms Q Kᵀ ⊙ (dO δᵀ ⊙ D)'s row and column sums from the pair terms
                mbarrier.arrive(hand.index(P_READY), count=1)
                dg_t = gl.zeros([BT], f32, r_t)
                dg_c = gl.zeros([BT], f32, gl.SliceLayout(0, l_t))
            else:
                b_qk = warpgroup_mma(s_q, s_k.permute((1, 0)), zt, use_acc=False) * dsm
                dg_t = gl.sum(b_qk, axis=1)
                dg_c = 0.0 - gl.sum(b_qk, axis=0)
            dg_t += gl.convert_layout(_dq(s_do, s_h, s_p, s_q, s_k, zh, G, DQ, t0, eos, HV, i_hv, scale, K), r_t)
            # dK's state term δ dSᵀ in two halves of K, after which dS is free for the chain's next
            b_k0 = warpgroup_mma(s_dl, s_ds.slice(0, HK, dim=0).permute((1, 0)), zh, use_acc=False, is_async=True)
            b_k1 = warpgroup_mma(s_dl, s_ds.slice(HK, HK, dim=0).permute((1, 0)), zh, use_acc=False, is_async=True)
            last = gl.minimum(eos, t0 + BT) - 1
            g_last = gl.load(G + last * HV + i_hv)
            rh, mh = _rows(t0, eos, l_h)
            g_h, b_bh = _at_rows(G, rh, mh, HV, i_hv), _at_rows(beta, rh, mh, HV, i_hv)
            e_h = gl.exp(g_h)
            w_h = gl.where(mh, gl.exp(g_last - g_h), 0.0)
            b_k0, b_k1 = warpgroup_mma_wait(0, deps=[b_k0, b_k1])
            mbarrier.arrive(hand.index(DS_FREE), count=1)
            mbarrier.arrive(empty2, count=1)  # A's last products through dO, h and δ
            b_k0 = b_k0 * w_h[:, None]
            b_k1 = b_k1 * w_h[:, None]
            b_a = gl.sum(s_k.slice(0, HK, dim=1).load(l_h).to(f32) * b_k0, axis=1)
            b_a += gl.sum(s_k.slice(HK, HK, dim=1).load(l_h).to(f32) * b_k1, axis=1)
            # the chunk's tail term through its last state: Σ k · (δ dSᵀ)'s rows (B adds exp(γ_C) Σ S ⊙ dS)
            ct = t0 + gl.arange(0, BT, layout=gl.SliceLayout(0, l_t))
            dg_c += gl.where(ct == last, gl.sum(b_a, axis=0), 0.0)
            # the rest of dK once B has formed M and dW
            if DK_B:  # the pair terms through Q here, B's terms from dδ's and dÕ's places
                b_k0 = warpgroup_mma(s_p, s_q.slice(0, HK, dim=1), b_k0, is_async=True)
                b_k1 = warpgroup_mma(s_p, s_q.slice(HK, HK, dim=1), b_k1, is_async=True)
                b_k0, b_k1 = warpgroup_mma_wait(0, deps=[b_k0, b_k1])
                mbarrier.arrive(empty, count=1)  # A's last read of q, k and T⁻¹: the next chunk's may land
                mbarrier.wait(hand.index(M_READY), par)
                _store_rows(DK, b_k0 + _part(u_dd, z).load(l_h), t0, eos, HV, i_hv, 0, K, HK)
                _store_rows(DK, b_k1 + _part(u_o, z).load(l_h), t0, eos, HV, i_hv, HK, K, HK)
                s_g.slice(0 * BT, BT).store(dg_t - gl.convert_layout(b_a, r_t))
                s_g.slice(1 * BT, BT).store(dg_c)
            else:
                mbarrier.wait(hand.index(M_READY), par)
                bg_h = b_bh * e_h
                ktdw = _dk_half(s_a, s_w, s_p, s_q, s_k, s_x, b_k0, bg_h, zh, DK, t0, eos, HV, i_hv, 0, K)
                ktdw += _dk_half(s_a, s_w, s_p, s_q, s_k, s_x, b_k1, bg_h, zh, DK, t0, eos, HV, i_hv, HK, K)
                s_g.slice(0 * BT, BT).store(dg_t + gl.convert_layout(ktdw * bg_h - b_a, r_t))
                s_g.slice(1 * BT, BT).store(dg_c)
                s_gb.store(gl.convert_layout(ktdw * e_h, r_t))
                mbarrier.arrive(empty, count=1)
        else:
            mbarrier.arrive(hand.index(DS_FREE), count=1)
            mbarrier.arrive(empty2, count=1)  # dO read for L and dÕ
            if QK_B:
                mbarrier.arrive(hand.index(P_READY), count=1)
            mbarrier.arrive(empty, count=1)
        mbarrier.arrive(hand.index(G_READY), count=1)


@gluon.jit
def _sig(s_h, s_ds, K: gl.constexpr):
    """Σ S ⊙ dS over the whole [K, V] tiles in shared memory (in row slices of 32)."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WG, 1], [1, 0])
    acc = gl.zeros([32], gl.float32, gl.SliceLayout(1, ld))
    for i in gl.static_range(K // 32):
        acc += gl.sum(s_h.slice(i * 32, 32, dim=0).load(ld).to(gl.float32)
                      * s_ds.slice(i * 32, 32, dim=0).load(ld).to(gl.float32), axis=1)
    return gl.sum(acc, axis=0)


@gluon.jit
def _dk_half(s_a, s_w, s_p, s_q, s_k, s_x, b_dk, bg_h, zh, DK, t0, eos, HV, i_hv, col: gl.constexpr, K: gl.constexpr):
    """Columns col … col + HK − 1 of dK to memory: the decayed state term ``b_dk`` plus diag(βΓ) Tᵀ dW,
    (dO δᵀ ⊙ D)ᵀ Q and (M + Mᵀ) K over those columns; returns the rows of k · Tᵀ dW over them (dβ's
    and dγ's term)."""
    k_i = s_k.slice(col, HK, dim=1)
    tdw, ktdw = _tdw(s_a, s_w, k_i, zh, col)
    b_dk = b_dk + tdw * bg_h[:, None]
    b_dk = warpgroup_mma(s_p, s_q.slice(col, HK, dim=1), b_dk, is_async=True)
    b_dk = warpgroup_mma(s_x, k_i, b_dk, is_async=True)
    b_dk = warpgroup_mma(s_x.permute((1, 0)), k_i, b_dk, is_async=True)
    b_dk = warpgroup_mma_wait(0, deps=[b_dk])
    _store_rows(DK, b_dk, t0, eos, HV, i_hv, col, K, HK)
    return ktdw


@gluon.jit
def _tdw(s_a, s_w, k_i, zh, col: gl.constexpr):
    """Tᵀ dW over columns col … col + HK − 1, and the rows of k · it there (dβ's and dγ's term)."""
    l_h: gl.constexpr = acc_layout(HK, WG)
    tdw = warpgroup_mma(s_a.permute((1, 0)), s_w.slice(col, HK, dim=1), zh, use_acc=False)
    return tdw, gl.sum(k_i.load(l_h).to(gl.float32) * tdw, axis=1)


@gluon.jit
def _dk_part(s_a, s_w, s_x, s_k, part, bg_h, zh, col: gl.constexpr):
    """B's terms of dK over columns col … col + HK − 1, diag(βΓ) Tᵀ dW + (M + Mᵀ) K, into ``part`` (a
    [64, 64] fp32 view of a free buffer) for A to add to its own; returns the rows of k · Tᵀ dW."""
    k_i = s_k.slice(col, HK, dim=1)
    tdw, ktdw = _tdw(s_a, s_w, k_i, zh, col)
    acc = warpgroup_mma(s_x, k_i, tdw * bg_h[:, None], is_async=True)
    acc = warpgroup_mma(s_x.permute((1, 0)), k_i, acc, is_async=True)
    part.store(warpgroup_mma_wait(0, deps=[acc]))
    return ktdw


@gluon.jit
def _part(u, z):
    """Buffer ``u``'s slot as a [64, 64] fp32 tile (a 16 KB [64, 128] 16-bit buffer): where B hands
    A a part of dK."""
    return u.index(z)._reinterpret(gl.float32, [BT, HK], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))


@gluon.jit
def _grad_b(u_k, u_q, u_a, u_dl, u_h, u_ds, u_dd, u_o, u_z, u_w, u_x, u_lo, u_p, s_g, s_gb, ready, empty, ready2,
            empty2, hand, G, beta, DV, DB, DG, cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, K: gl.constexpr,
            V: gl.constexpr, DT: gl.constexpr, WARM: gl.constexpr, QK_B: gl.constexpr, DK_B: gl.constexpr):
    """B: K dS, dδ over L, Y = Tᵀ dδ, Z for the chain; on own chunks dV, Σ S ⊙ dS (then dS is free),
    dW and dδ δᵀ's parts (its last reads of h, v and δ), dA, K Kᵀ and M (handed to A with dW), dβ
    and dg (with the chunk's tail term through its last state)."""
    f32: gl.constexpr = gl.float32
    l_v: gl.constexpr = acc_layout(V, WG)
    l_t: gl.constexpr = acc_layout(BT, WG)
    r_t: gl.constexpr = gl.SliceLayout(1, l_t)
    c_t: gl.constexpr = gl.SliceLayout(0, l_t)
    l_h: gl.constexpr = acc_layout(HK, WG)
    zt = gl.zeros([BT, BT], f32, l_t)
    zv = gl.zeros([BT, V], f32, l_v)
    bos, eos, nw, nc = _span(cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, WARM)
    for j in range(nc):
        z = j // nc  # zero, not provably so: the MMA operand descriptors stay in the loop
        s_k = u_k.index(z)
        s_q = u_q.index(z)
        s_a = u_a.index(z)
        s_dl = u_dl.index(z)
        s_h = u_h.index(z)
        s_ds = u_ds.index(z)
        s_dd = u_dd.index(z)
        s_z = u_z.index(z)
        s_w = u_w.index(z)
        s_x = u_x.index(z)
        s_lo = u_lo.index(z)
        par = j & 1
        t0 = bos + (nc - 1 - j) * BT
        last = gl.minimum(eos, t0 + BT) - 1
        g_last = gl.load(G + last * HV + i_hv)
        rv, mv = _rows(t0, eos, l_v)
        g_v, b_bv = _at_rows(G, rv, mv, HV, i_hv), _at_rows(beta, rv, mv, HV, i_hv)
        mbarrier.wait(ready, par)
        mbarrier.wait(hand.index(DS_READY), par)
        b_x = warpgroup_mma(s_k, s_ds, zv, use_acc=False)
        if j < nw:
            mbarrier.arrive(hand.index(DS_FREE), count=1)
        mbarrier.wait(hand.index(L_READY), par)
        b_d = b_x * gl.where(mv, gl.exp(g_last - g_v), 0.0)[:, None] + s_dd.load(l_v).to(f32)
        s_dd.store(b_d.to(DT))
        fence_async_shared()
        b_y = warpgroup_mma(s_a.permute((1, 0)), s_dd, zv, use_acc=False)
        dbu = gl.zeros([BT], f32, gl.SliceLayout(1, l_v))  # dβ's term Σ_v v ⊙ Y
        if j >= nw:  # v landed in Z's place: read before Z goes there (each warp its own rows)
            mbarrier.wait(ready2, par)
            dbu = gl.sum(s_z.load(l_v).to(f32) * b_y, axis=1)
        mbarrier.wait(hand.index(Z_FREE), par ^ 1)  # the chain's previous update has read Z
        s_z.store((b_y * (0.0 - b_bv * gl.exp(g_v))[:, None]).to(DT))
        fence_async_shared()
        mbarrier.arrive(hand.index(Z_READY), count=1)
        # A's parts of dγ and dβ are waited for at the end, so that B's products run beside A's
        if j >= nw:
            _store_rows(DV, b_y * b_bv[:, None], t0, eos, HV, i_hv, 0, V, V)  # dV = diag(β) Y
            # Σ S ⊙ dS over the whole [K, V] tiles (dγ's tail term), after which dS is free for B
            sig = _sig(s_h, s_ds, K)
            mbarrier.arrive(hand.index(DS_FREE), count=1)
            # dW = −dδ Sᵀ to shared memory; dδ δᵀ as a 16-bit part and its remainder
            b_w = warpgroup_mma(s_dd, s_h.permute((1, 0)), zv, use_acc=False)
            s_w.store((0.0 - b_w).to(DT))
            b_dd = warpgroup_mma(s_dd, s_dl.permute((1, 0)), zt, use_acc=False)
            hi = b_dd.to(DT)
            s_x.store(hi)
            s_lo.store((b_dd - hi.to(f32)).to(DT))
            fence_async_shared()
            mbarrier.arrive(hand.index(DD_FREE), count=1)
            mbarrier.arrive(empty2, count=1)  # B's last products through h, v and δ
            b_da = warpgroup_mma(s_a.permute((1, 0)), s_x, zt, use_acc=False, is_async=True)
            b_da = warpgroup_mma(s_a.permute((1, 0)), s_lo, b_da, is_async=True)
            b_kk = warpgroup_mma(s_k, s_k.permute((1, 0)), zt, use_acc=False, is_async=True)
            # dA = −(Tᵀ (dδ δᵀ)) ⊙ D strictly below the diagonal; M = diag(β) dA; dβ's and dγ's terms
            dec, strict = _decay(G, t0, eos, HV, i_hv, l_t, False)
            rt, mt = _rows(t0, eos, l_t)
            b_bt = _at_rows(beta, rt, mt, HV, i_hv)
            b_da, b_kk = warpgroup_mma_wait(0, deps=[b_da, b_kk])
            b_da = 0.0 - gl.where(strict, b_da * dec, 0.0)
            b_kk = b_da * b_kk  # dA ⊙ K Kᵀ
            db = gl.sum(b_kk, axis=1)
            b_e2 = b_kk * b_bt[:, None]
            b_m = b_da * b_bt[:, None]
            dg_t = gl.sum(b_e2, axis=1)
            dg_c = 0.0 - gl.sum(b_e2, axis=0)
            s_x.store(b_m.to(DT))  # M over dδ δᵀ's first part (its products are done)
            fence_async_shared()
            if DK_B:  # dK's terms through M and dW, handed to A in dδ's place and (once read) dÕ's
                e_h = gl.exp(_at_rows(G, rt, mt, HV, i_hv))  # (HK = BT: the rows' layout is l_t's)
                bg_h = b_bt * e_h
                zh = gl.zeros([BT, HK], f32, l_h)
                ktdw = _dk_part(s_a, s_w, s_x, s_k, _part(u_dd, z), bg_h, zh, 0)
                mbarrier.wait(hand.index(O_FREE), par)  # the chain has read this chunk's dÕ
                ktdw += _dk_part(s_a, s_w, s_x, s_k, _part(u_o, z), bg_h, zh, HK)
                db += gl.convert_layout(ktdw * e_h, r_t)
                dg_t += gl.convert_layout(ktdw * bg_h, r_t)
            mbarrier.arrive(hand.index(M_READY), count=1)
            if QK_B:  # dγ's pair terms: Q Kᵀ ⊙ (dO δᵀ ⊙ D · scale), the latter from A's 16-bit copy
                b_qk = warpgroup_mma(s_q, s_k.permute((1, 0)), zt, use_acc=False)
            mbarrier.arrive(empty, count=1)  # B's last read of q, k and T⁻¹: the next chunk's may land
            if QK_B:
                mbarrier.wait(hand.index(P_READY), par)
                b_qk = b_qk * u_p.index(z).permute((1, 0)).load(l_t).to(f32)
                mbarrier.arrive(hand.index(P_FREE), count=1)
                dg_t += gl.sum(b_qk, axis=1)
                dg_c -= gl.sum(b_qk, axis=0)
            mbarrier.wait(hand.index(G_READY), par)
            dg_t += s_g.slice(0 * BT, BT).load(r_t)
            dg_c += s_g.slice(1 * BT, BT).load(c_t)
            if not DK_B:
                db += s_gb.load(r_t)
            mbarrier.arrive(hand.index(G_FREE), count=1)
            # dβ; dγ = A's and B's terms (A added the chunk's tail on its last row); dg its reverse cumsum
            db += gl.convert_layout(dbu, r_t)
            gl.store(DB + rt * HV + i_hv, db, mask=mt)
            ct = t0 + gl.arange(0, BT, layout=c_t)
            dg_c += gl.convert_layout(dg_t, c_t) + gl.where(ct == last, gl.exp(g_last) * sig, 0.0)
            after = ct[None, :] >= rt[:, None]
            gl.store(DG + rt * HV + i_hv, gl.sum(gl.where(after, dg_c[None, :], 0.0), axis=1), mask=mt)
        else:
            mbarrier.arrive(hand.index(DD_FREE), count=1)
            mbarrier.arrive(hand.index(M_READY), count=1)
            mbarrier.wait(hand.index(G_READY), par)
            mbarrier.arrive(hand.index(G_FREE), count=1)
            mbarrier.arrive(empty2, count=1)  # nothing of that slot read on a warm-up chunk
            if QK_B:
                mbarrier.arrive(hand.index(P_FREE), count=1)
            mbarrier.arrive(empty, count=1)


@gluon.jit
def _dq(s_do, s_h, s_p, s_q, s_k, zh, G, DQ, t0, eos, HV, i_hv, scale, K: gl.constexpr):
    """dQ to memory in two halves of K: dO Sᵀ scaled by rows (q · it: dγ's term, returned), plus
    (dO δᵀ ⊙ D) K from the pair terms in ``s_p`` (stored transposed)."""
    l_h: gl.constexpr = acc_layout(HK, WG)
    rh, mh = _rows(t0, eos, l_h)
    g_h = _at_rows(G, rh, mh, HV, i_hv)
    e_h = gl.where(mh, scale * gl.exp(g_h), 0.0)
    dg_k = gl.zeros([BT], gl.float32, gl.SliceLayout(1, l_h))
    for i in gl.static_range(K // HK):
        b_dq = warpgroup_mma(s_do, s_h.slice(i * HK, HK, dim=0).permute((1, 0)), zh, use_acc=False)
        b_dq = b_dq * e_h[:, None]
        dg_k += gl.sum(s_q.slice(i * HK, HK, dim=1).load(l_h).to(gl.float32) * b_dq, axis=1)
        b_dq = warpgroup_mma(s_p.permute((1, 0)), s_k.slice(i * HK, HK, dim=1), b_dq)
        _store_rows(DQ, b_dq, t0, eos, HV, i_hv, i * HK, K, HK)
    return dg_k


@gluon.jit
def fused_rbwd_kernel(q_t, k_t, do_t, a_t, d_t, h_t, v_t, G, beta, dht, dh0, DQ, DK, DV, DB, DG, cu, ends, off, plan,
                      seg_seq, seq_cu, scale, H, HV, K: gl.constexpr, V: gl.constexpr, DT: gl.constexpr,
                      USE_DHT: gl.constexpr, USE_INIT: gl.constexpr, WARM: gl.constexpr, R_COPY: gl.constexpr,
                      R_A: gl.constexpr, R_B: gl.constexpr, QK_B: gl.constexpr, DK_B: gl.constexpr):
    """One program per (token range [cu[i_n], ends[i_n]), value head), program id i_n · HV + i_hv.
    Descriptors: q_t, k_t of [T, H · K] in [64, K] blocks; do_t, d_t (δ), v_t of [T, HV · V] in [64,
    V] blocks; a_t (T⁻¹) of [T, HV · 64] in [64, 64] blocks; h_t of [chunks · HV · K, V] in [K, V]
    blocks (the state entering each chunk at its global index off[i_n] + its index in the range).
    G (γ) and beta [T, HV] fp32; dht, dh0 [N, HV, K, V] fp32; DQ, DK [T, HV, K], DV
    [T, HV, V], DB, DG [T, HV] fp32. ``WARM``: the ranges are warm-started segments (fused_rev's
    form: plan [NS, HV] the warm-up chunks after each, seg_seq their sequences, seq_cu the
    sequences' bounds). R_*: registers a thread of the copy, A and B partitions (the chain takes
    the rest of the launch's ``maxnreg``)."""
    pid = gl.program_id(0)
    i_n = pid // HV
    i_hv = pid % HV
    i_h = i_hv // (HV // H)
    rows: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, V], DT)
    sq_t: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], DT)
    s_q = gl.allocate_shared_memory(DT, [1, BT, K], q_t.layout)
    s_k = gl.allocate_shared_memory(DT, [1, BT, K], k_t.layout)
    s_do = gl.allocate_shared_memory(DT, [1, BT, V], do_t.layout)
    s_dl = gl.allocate_shared_memory(DT, [1, BT, V], d_t.layout)
    s_a = gl.allocate_shared_memory(DT, [1, BT, BT], a_t.layout)
    s_h = gl.allocate_shared_memory(DT, [1, K, V], h_t.layout)
    s_ds = gl.allocate_shared_memory(DT, [1, K, V], h_t.layout)
    s_dd = gl.allocate_shared_memory(DT, [1, BT, V], rows)
    s_z = gl.allocate_shared_memory(DT, [1, BT, V], rows)
    s_o = gl.allocate_shared_memory(DT, [1, BT, V], rows)
    s_w = gl.allocate_shared_memory(DT, [1, BT, K], q_t.layout)
    s_p = gl.allocate_shared_memory(DT, [1, BT, BT], sq_t)
    s_x = gl.allocate_shared_memory(DT, [1, BT, BT], sq_t)
    s_lo = gl.allocate_shared_memory(DT, [1, BT, BT], sq_t)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    s_g = gl.allocate_shared_memory(gl.float32, [2 * BT], vec)  # A's dγ terms: by rows, by columns
    s_gb = gl.allocate_shared_memory(gl.float32, [BT], vec)  # A's dβ term
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    hand = gl.allocate_shared_memory(gl.int64, [NHAND, 1], mbarrier.MBarrierLayout())
    ready2 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # the second slot
    empty2 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(empty, count=3)  # the chain, A and B
    mbarrier.init(ready2, count=1)
    mbarrier.init(empty2, count=2)  # A and B
    for i in gl.static_range(NHAND):
        mbarrier.init(hand.index(i), count=2 if i == DS_FREE else 1)
    fence_async_shared()
    gl.warp_specialize([
        (_chain, (s_q, s_k, s_ds, s_o, s_z, ready, empty, hand, G, dht, dh0, cu, ends, plan, seg_seq, seq_cu, i_n,
                  i_hv, HV, K, V, DT, USE_DHT, USE_INIT, WARM)),
        (_copies, (q_t, k_t, do_t, a_t, d_t, h_t, v_t, s_q, s_k, s_do, s_a, s_dl, s_h, s_z, ready, empty, ready2,
                   empty2, hand, cu, ends, off, plan, seg_seq, seq_cu, i_n, i_h, i_hv, HV, K, V, WARM)),
        (_grad_a, (s_q, s_k, s_do, s_dl, s_h, s_ds, s_dd, s_o, s_p, s_a, s_w, s_x, s_g, s_gb, ready, empty, ready2,
                   empty2, hand, G, beta, DQ, DK, cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, scale, K, V, DT,
                   WARM, QK_B, DK_B)),
        (_grad_b, (s_k, s_q, s_a, s_dl, s_h, s_ds, s_dd, s_o, s_z, s_w, s_x, s_lo, s_p, s_g, s_gb, ready, empty,
                   ready2, empty2, hand, G, beta, DV, DB, DG, cu, ends, plan, seg_seq, seq_cu, i_n, i_hv, HV, K, V,
                   DT, WARM, QK_B, DK_B)),
    ], [1, WG, WG], [R_COPY, R_A, R_B])


def usable(q, g, beta, K: int, V: int) -> bool:
    """Whether this kernel takes the backward (``DELTA["fused_rbwd"]["on"]``): gated delta member,
    16-bit inputs, K = V = 128, on a device that runs the Gluon kernels (fused_bwd.hopper)."""
    return (bool(DELTA["fused_rbwd"]["on"]) and g is not None and beta is not None
            and q.dtype in (torch.bfloat16, torch.float16) and K == V == 128 and hopper(q))


def backward(q, k, v, do, G, beta, Ai, VN, h, dht, dh0, DQ, DK, DV, DB, DG, cu, ends, off, N: int, scale: float,
             warm=None):
    """Launch the kernel over N programs' token ranges [cu, ends) (sequences, or warm-started
    segments with ``warm`` = (plan, seg_seq, seq_cu)): fills DQ, DK [T, HV, K], DV [T, HV, V], DB,
    DG [T, HV] and dh0 [N, HV, K, V] (fp32) when given. q, k [T, H, K]; v, do, VN (δ) [T, HV, V];
    G (γ), beta [T, HV] fp32; Ai [T, HV, 64]; h [chunks, HV, K, V] (the recomputed states, from
    ``off`` on per program). DV may be VN: a chunk's dV rows are stored after its δ has landed."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    c = DELTA["fused_rbwd"]
    DT = gl.bfloat16 if v.dtype == torch.bfloat16 else gl.float16
    q_t, k_t = (_tiles(x, T, (CHUNK, K), DT) for x in (q, k))
    do_t, d_t, v_t = (_tiles(x, T, (CHUNK, V), DT) for x in (do, VN, v))
    a_t = _tiles(Ai, T, (CHUNK, CHUNK), DT)
    h_t = _tiles(h, h.numel() // V, (K, V), DT)
    plan, seg_seq, seq_cu = warm if warm is not None else (cu, cu, cu)
    r = tuple(c["regs"])
    launch(fused_rbwd_kernel, (N * HV,), q_t, k_t, do_t, a_t, d_t, h_t, v_t, G, beta,
           dht if dht is not None else G, dh0 if dh0 is not None else G, DQ, DK, DV, DB, DG, cu, ends, off, plan,
           seg_seq, seq_cu, scale, H, HV, K=K, V=V, DT=DT, USE_DHT=dht is not None, USE_INIT=dh0 is not None,
           WARM=warm is not None, R_COPY=r[0], R_A=r[1], R_B=r[2], QK_B=bool(c["qk_b"]), DK_B=bool(c["dk_b"]),
           maxnreg=c["maxnreg"], name="fused_rbwd")
