"""Registers, spills and shared memory, for sm_90, of the warpgroup split a reverse pass doing the
backward's per-chunk work would take (docs/TRITON.md, "Next: one reverse pass that does the
per-chunk work"), without a GPU: a probe kernel with the split's roles, accumulators, shared tiles
and products per chunk, compiled and counted. Nothing runs and nothing in it is checked for
values: its products are those of the pass (shapes, operands, which role holds what), its
elementwise work is reduced to what keeps each product's result live.

Roles (one program: a sequence and value head, K = V = 128, bf16 tiles):

- chain (the default partition, 4 warps): dS [K, V] fp32 as the accumulator of its update
  Γ_C dS + (diag(sΓ) Q)ᵀ dO + Kᵀ Z; publishes dS in 16 bits each chunk.
- B (4 warps): K dS and Tᵀ dδ for the chain (dδ written over L's place, Z and dV from the one
  product), and the dK accumulator's products: dW = −dδ Sᵀ first, then dK from Tᵀ dW (scaled by
  rows in place), δ dSᵀ into it, and (M + Mᵀ) K with M from Tᵀ (dδ δᵀ): one [64, K] product live
  beside the accumulator at most.
- A (4 warps): Pᵀ = K Qᵀ and L = Pᵀ dO ahead of the chain, δ = T (V − K S) from h, dO δᵀ, and the
  dQ accumulator's products: dO Sᵀ and (dO δᵀ ⊙ D) K.
- copies (1 warp): q, k, dO, v, T and h of each chunk by tensor copies.

dW (B's) and V − ΓKS (A's) share one buffer: their uses never overlap in time (K = V here).

    python tools/merged_probe.py [--regs 24,160,160] [--maxnreg 128] [--only A|B|chain] [--sass FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gdn.ops.delta.triton.fused_bwd import acc_layout  # noqa: E402
from tools.gluon_budget import _aligned, _compiled, desc_type  # noqa: E402

BT = gl.constexpr(64)
WG = gl.constexpr(4)


@gluon.jit
def _copies(q_t, k_t, do_t, v_t, a_t, h_t, s_q, s_k, s_do, s_v, s_a, s_h, ready, empty, nc, K: gl.constexpr,
            V: gl.constexpr):
    nbytes: gl.constexpr = (2 * BT * K + 2 * BT * V + BT * BT + K * V) * 2
    for j in range(nc):
        mbarrier.wait(empty, (j & 1) ^ 1)
        t0 = (nc - 1 - j) * BT
        mbarrier.expect(ready, nbytes)
        tma.async_copy_global_to_shared(q_t, [t0, 0], ready, s_q)
        tma.async_copy_global_to_shared(k_t, [t0, 0], ready, s_k)
        tma.async_copy_global_to_shared(do_t, [t0, 0], ready, s_do)
        tma.async_copy_global_to_shared(v_t, [t0, 0], ready, s_v)
        tma.async_copy_global_to_shared(a_t, [t0, 0], ready, s_a)
        tma.async_copy_global_to_shared(h_t, [(nc - 1 - j) * K, 0], ready, s_h)


@gluon.jit
def _decay(G, t0, l_t: gl.constexpr):
    """The chunk's [64, 64] decay matrix exp(γ_c − γ_r) on and above the diagonal, zero below it, in
    layout l_t (that of Pᵀ = K Qᵀ)."""
    o_r = gl.arange(0, BT, layout=gl.SliceLayout(1, l_t))
    o_c = gl.arange(0, BT, layout=gl.SliceLayout(0, l_t))
    g_r = gl.load(G + t0 + o_r)
    g_c = gl.load(G + t0 + o_c)
    return gl.exp(gl.where(o_c[None, :] >= o_r[:, None], g_c[None, :] - g_r[:, None], float("-inf")))


@gluon.jit
def _store_rows(X, t0, x, N: gl.constexpr):
    """Rows t0 … t0 + 63 of the [T, N] output X from a [64, N] accumulator (bf16)."""
    l_x: gl.constexpr = acc_layout(N, WG)
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, l_x))
    o_n = gl.arange(0, N, layout=gl.SliceLayout(0, l_x))
    gl.store(X + (t0 + o_t)[:, None] * N + o_n[None, :], x.to(gl.bfloat16))


@gluon.jit
def _chain(s_q, s_k, s_do, s_ds, s_z, ready, empty, hand, G, dh0, nc, K: gl.constexpr, V: gl.constexpr):
    l_s: gl.constexpr = acc_layout(V, WG)
    b_s = gl.zeros([K, V], gl.float32, l_s)
    for j in range(nc):
        par = j & 1
        mbarrier.wait(hand.index(1), par ^ 1)  # B and A are done with the previous dS
        s_ds.store(b_s.to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(hand.index(0), count=1)  # dS published
        mbarrier.wait(ready, par)
        b_gc = gl.exp(gl.load(G + (nc - 1 - j) * BT))
        b_s = warpgroup_mma(s_q.permute((1, 0)), s_do, b_s * b_gc, is_async=True)
        mbarrier.wait(hand.index(2), par)  # Z
        b_s = warpgroup_mma(s_k.permute((1, 0)), s_z, b_s, is_async=True)
        b_s = warpgroup_mma_wait(0, deps=[b_s])
        mbarrier.arrive(empty, count=1)
    o_k = gl.arange(0, K, layout=gl.SliceLayout(1, l_s))
    o_v = gl.arange(0, V, layout=gl.SliceLayout(0, l_s))
    gl.store(dh0 + o_k[:, None] * V + o_v[None, :], b_s)


@gluon.jit
def _grad_b(s_k, s_a, s_h, s_ds, s_dd, s_dl, s_z, s_dw, s_m, ready, empty, hand, G, DK, DV, nc, K: gl.constexpr,
            V: gl.constexpr, ON: gl.constexpr):
    """K dS, dδ (over L), Tᵀ dδ (Z, dV), then dK: δ dSᵀ + Tᵀ dW ⊙ rows + (M + Mᵀ) K."""
    l_v: gl.constexpr = acc_layout(V, WG)
    l_k: gl.constexpr = acc_layout(K, WG)
    l_t: gl.constexpr = acc_layout(BT, WG)
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, l_v))
    o_tk = gl.arange(0, BT, layout=gl.SliceLayout(1, l_k))
    zv = gl.zeros([BT, V], gl.float32, l_v)
    zk = gl.zeros([BT, K], gl.float32, l_k)
    zt = gl.zeros([BT, BT], gl.float32, l_t)
    for j in range(nc):
        par = j & 1
        t0 = (nc - 1 - j) * BT
        g_t = gl.load(G + t0 + o_t)
        mbarrier.wait(ready, par)
        mbarrier.wait(hand.index(0), par)  # dS
        mbarrier.wait(hand.index(3), par)  # L in s_dd, δ in s_dl (from A)
        if ON:
            b_x = warpgroup_mma(s_k, s_ds, zv, use_acc=False)
            b_d = (b_x * gl.exp(g_t)[:, None] + s_dd.load(l_v).to(gl.float32)).to(gl.bfloat16)
            s_dd.store(b_d)
            fence_async_shared()
            b_y = warpgroup_mma(s_a.permute((1, 0)), s_dd, zv, use_acc=False)
            s_z.store((b_y * (0.0 - gl.exp(g_t))[:, None]).to(gl.bfloat16))
            fence_async_shared()
            mbarrier.arrive(hand.index(2), count=1)  # Z
            _store_rows(DV, t0, b_y, V)
            # dK's products: dW first (its product dead once stored), then the dK accumulator starts
            # from Tᵀ dW scaled by rows in place and takes δ dSᵀ into it, so no second [64, K]
            # product is live beside it
            b_w = warpgroup_mma(s_dd, s_h.permute((1, 0)), zk, use_acc=False)
            s_dw.store((0.0 - b_w).to(gl.bfloat16))
            fence_async_shared()
            b_dk = warpgroup_mma(s_a.permute((1, 0)), s_dw, zk, use_acc=False)
            b_dk = b_dk * gl.exp(gl.load(G + t0 + o_tk))[:, None]
            b_dk = warpgroup_mma(s_dl, s_ds.permute((1, 0)), b_dk, is_async=True)
            b_dk = warpgroup_mma_wait(0, deps=[b_dk])
            b_e = warpgroup_mma(s_dd, s_dl.permute((1, 0)), zt, use_acc=False)
            s_m.store(b_e.to(gl.bfloat16))
            mbarrier.arrive(hand.index(1), count=1)  # done with dS, dδ and δ
            fence_async_shared()
            b_da = warpgroup_mma(s_a.permute((1, 0)), s_m, zt, use_acc=False)
            gl.thread_barrier()
            s_m.store(b_da.to(gl.bfloat16))
            fence_async_shared()
            b_dk = warpgroup_mma(s_m, s_k, b_dk, is_async=True)
            b_dk = warpgroup_mma(s_m.permute((1, 0)), s_k, b_dk, is_async=True)
            b_dk = warpgroup_mma_wait(0, deps=[b_dk])
            _store_rows(DK, t0, b_dk, K)
            mbarrier.arrive(empty, count=1)
        else:
            mbarrier.arrive(hand.index(2), count=1)
            mbarrier.arrive(hand.index(1), count=1)
            mbarrier.arrive(empty, count=1)


@gluon.jit
def _grad_a(s_q, s_k, s_do, s_v, s_a, s_h, s_ds, s_dd, s_dl, s_p, s_u, ready, empty, hand, G, DQ, nc,
            K: gl.constexpr, V: gl.constexpr, ON: gl.constexpr):
    """Pᵀ, L (into dδ's place), δ = T (V − K S) from h, dO δᵀ, then dQ: dO Sᵀ + (dO δᵀ ⊙ D) K."""
    l_v: gl.constexpr = acc_layout(V, WG)
    l_k: gl.constexpr = acc_layout(K, WG)
    l_t: gl.constexpr = acc_layout(BT, WG)
    o_tv = gl.arange(0, BT, layout=gl.SliceLayout(1, l_v))
    zv = gl.zeros([BT, V], gl.float32, l_v)
    zk = gl.zeros([BT, K], gl.float32, l_k)
    zt = gl.zeros([BT, BT], gl.float32, l_t)
    for j in range(nc):
        par = j & 1
        t0 = (nc - 1 - j) * BT
        mbarrier.wait(ready, par)
        if ON:
            b_p = warpgroup_mma(s_k, s_q.permute((1, 0)), zt, use_acc=False)
            s_p.store((b_p * _decay(G, t0, l_t)).to(gl.bfloat16))
            fence_async_shared()
            b_l = warpgroup_mma(s_p, s_do, zv, use_acc=False)
            mbarrier.wait(hand.index(1), par ^ 1)  # B is done with the previous chunk's dδ and δ
            s_dd.store(b_l.to(gl.bfloat16))
            b_ks = warpgroup_mma(s_k, s_h, zv, use_acc=False)
            g_v = gl.load(G + t0 + o_tv)
            s_u.store((s_v.load(l_v).to(gl.float32) - b_ks * gl.exp(g_v)[:, None]).to(gl.bfloat16))
            fence_async_shared()
            b_dl = warpgroup_mma(s_a, s_u, zv, use_acc=False)
            s_dl.store(b_dl.to(gl.bfloat16))
            fence_async_shared()
            mbarrier.arrive(hand.index(3), count=1)  # L and δ
            b_e = warpgroup_mma(s_do, s_dl.permute((1, 0)), zt, use_acc=False, is_async=True)
            b_dq = warpgroup_mma(s_do, s_h.permute((1, 0)), zk, use_acc=False, is_async=True)
            b_e, b_dq = warpgroup_mma_wait(0, deps=[b_e, b_dq])
            dec = _decay(G, t0, l_t)  # formed again rather than held
            gl.thread_barrier()
            s_p.store(gl.permute((b_e * dec).to(gl.bfloat16), (1, 0)))
            fence_async_shared()
            b_dq = warpgroup_mma(s_p.permute((1, 0)), s_k, b_dq, is_async=True)
            b_dq = warpgroup_mma_wait(0, deps=[b_dq])
            _store_rows(DQ, t0, b_dq, K)
            mbarrier.arrive(empty, count=1)
        else:
            mbarrier.arrive(hand.index(3), count=1)
            mbarrier.arrive(empty, count=1)


@gluon.jit
def merged_probe_kernel(q_t, k_t, do_t, v_t, a_t, h_t, G, DQ, DK, DV, dh0, nc, K: gl.constexpr, V: gl.constexpr,
                        R_COPY: gl.constexpr, R_A: gl.constexpr, R_B: gl.constexpr, ON_A: gl.constexpr = True,
                        ON_B: gl.constexpr = True):
    dt: gl.constexpr = gl.bfloat16
    rows_v: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, V], dt)
    sq_t: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT], dt)
    s_q = gl.allocate_shared_memory(dt, [BT, K], q_t.layout)
    s_k = gl.allocate_shared_memory(dt, [BT, K], k_t.layout)
    s_do = gl.allocate_shared_memory(dt, [BT, V], do_t.layout)
    s_v = gl.allocate_shared_memory(dt, [BT, V], v_t.layout)
    s_a = gl.allocate_shared_memory(dt, [BT, BT], a_t.layout)
    s_h = gl.allocate_shared_memory(dt, [K, V], h_t.layout)
    s_ds = gl.allocate_shared_memory(dt, [K, V], h_t.layout)
    s_dd = gl.allocate_shared_memory(dt, [BT, V], rows_v)
    s_dl = gl.allocate_shared_memory(dt, [BT, V], rows_v)
    s_z = gl.allocate_shared_memory(dt, [BT, V], rows_v)
    s_u = gl.allocate_shared_memory(dt, [BT, V], rows_v)
    # dW (B's, between A's L and δ of a chunk and B's release of it) shares U's place (A's, between
    # that release and the next chunk's L and δ): their uses never overlap in time
    s_dw = s_u
    s_p = gl.allocate_shared_memory(dt, [BT, BT], sq_t)
    s_m = gl.allocate_shared_memory(dt, [BT, BT], sq_t)
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    hand = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(empty, count=3)
    for i in gl.static_range(4):
        mbarrier.init(hand.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_chain, (s_q, s_k, s_do, s_ds, s_z, ready, empty, hand, G, dh0, nc, K, V)),
        (_copies, (q_t, k_t, do_t, v_t, a_t, h_t, s_q, s_k, s_do, s_v, s_a, s_h, ready, empty, nc, K, V)),
        (_grad_a, (s_q, s_k, s_do, s_v, s_a, s_h, s_ds, s_dd, s_dl, s_p, s_u, ready, empty, hand, G, DQ, nc, K, V, ON_A)),
        (_grad_b, (s_k, s_a, s_h, s_ds, s_dd, s_dl, s_z, s_dw, s_m, ready, empty, hand, G, DK, DV, nc, K, V, ON_B)),
    ], [1, WG, WG], [R_COPY, R_A, R_B])


def probe(K: int = 128, V: int = 128, regs=(24, 160, 160), maxnreg: int = 128, on=(True, True),
          cubin: bool = False) -> dict:
    """{"regs", "spill", "shared"} of the probe compiled for sm_90 (4 warps launched, the workers'
    registers ``regs`` = (copies, A, B), the chain taking the rest of ``maxnreg`` times the program's
    warps); with ``cubin`` its "cubin" too."""
    desc = desc_type
    sig = dict(q_t=desc(64, K), k_t=desc(64, K), do_t=desc(64, V), v_t=desc(64, V), a_t=desc(64, 64),
               h_t=desc(K, V), G="*fp32", DQ="*bf16", DK="*bf16", DV="*bf16", dh0="*fp32", nc="i32")
    const = dict(K=K, V=V, R_COPY=regs[0], R_A=regs[1], R_B=regs[2], ON_A=on[0], ON_B=on[1])
    sig.update({n: "constexpr" for n in const})
    names = merged_probe_kernel.arg_names
    at = {n: i for i, n in enumerate(names)}
    consts = {(at[n],): v for n, v in const.items()}
    sig = {n: sig[n] for n in names}
    return _compiled(GluonASTSource(merged_probe_kernel, sig, consts, _aligned(sig, at)), 4, cubin=cubin,
                     maxnreg=maxnreg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regs", default="24,160,160", help="registers a thread of the copy, A and B partitions")
    ap.add_argument("--maxnreg", type=int, default=128)
    ap.add_argument("--only", default=None, choices=["A", "B", "chain"],
                    help="compile that role's work alone (the others only pass the handshakes on)")
    ap.add_argument("--sass", default=None, metavar="FILE", help="also write the compiled kernel's SASS there")
    a = ap.parse_args(argv)
    regs = tuple(int(x) for x in a.regs.split(","))
    on = {None: (True, True), "A": (True, False), "B": (False, True), "chain": (False, False)}[a.only]
    r = probe(regs=regs, maxnreg=a.maxnreg, on=on, cubin=bool(a.sass))
    if a.sass:
        from tools.gluon_budget import sass  # noqa: PLC0415

        Path(a.sass).write_text(sass(r["cubin"]))
    print(f"regs {regs} maxnreg {a.maxnreg}: {r['regs']} registers, {r['spill']} spill bytes, "
          f"{r['shared'] / 1024:.0f} KB shared")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
