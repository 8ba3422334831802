"""The math of the Gluon fused backward (gdn.ops.delta.triton.fused_bwd), which has no interpreter:
a PyTorch transcription of its kernel, step for step (the same products, masks, decays, the
rounded operands and dA from dδ δᵀ split in two), put in its place in the chunk op's backward on
the CPU, gives the float64 reference's gradients. The GPU test (tests/gpu/test_fused_bwd.py)
checks the kernel itself."""
from __future__ import annotations

import pytest
import torch

from gdn.ops import tuning
from gdn.ops.triton import common

from .test_triton_chunk import TOL, _record_launches, _run_both

BT = 64


def transcription(q, k, v, G, beta, Ai, VN, do, h, dh, DD, ch, scale, grad_dtype, dv_dtype):
    """fused_bwd.backward's results, computed chunk by chunk as fused_bwd_kernel does (fp32
    accumulation; operands rounded to the input dtype where the kernel rounds them)."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    dt, f = v.dtype, torch.float32
    DQ = torch.zeros(T, HV, K, dtype=f)
    DK, DV = torch.zeros(T, HV, K, dtype=f), torch.zeros(T, HV, V, dtype=f)
    DB, DG = torch.zeros(T, HV, dtype=f), torch.zeros(T, HV, dtype=f)
    idx = ch.chunk_idx.view(-1, 2).tolist()
    cu = ch.cu.tolist()
    o = torch.arange(BT)
    for i_t, (i_n, i_c) in enumerate(idx):
        t0, eos = cu[i_n] + i_c * BT, cu[i_n + 1]
        n = min(eos, t0 + BT) - t0  # valid rows
        for i_hv in range(HV):
            i_h = i_hv // (HV // H)

            def rows(x, w):  # the chunk's rows of x[:, head], zero past the sequence end
                out = torch.zeros(BT, w, dtype=f)
                out[:n] = x[t0:t0 + n].float()
                return out

            tq, tk = rows(q[:, i_h], K), rows(k[:, i_h], K)
            tt = rows(Ai[:, i_hv], BT).T  # Tᵀ
            dl, dO, dd, vv = (rows(x[:, i_hv], V) for x in (VN, do, DD, v))
            S, dS = h[i_t, i_hv].float(), dh[i_t, i_hv].float()
            g = torch.zeros(BT)
            g[:n] = G[t0:t0 + n, i_hv]
            g_last = float(G[t0 + n - 1, i_hv])
            b = torch.zeros(BT)
            b[:n] = beta[t0:t0 + n, i_hv].float()
            valid = o < n
            # the value loop
            dod, ddd = dO @ dl.T, dd @ dl.T
            dqs, dks, wac = dO @ S.T, dl @ dS.T, dd @ S.T
            y = tt @ dd
            DV[t0:t0 + n, i_hv] = (y * b[:, None])[:n]
            dbu = (vv * y).sum(1)
            gcs = (S * dS).sum()
            # the epilogue
            dW = (-wac).to(dt).float()
            hi = ddd.to(dt).float()
            lo = (ddd - hi).to(dt).float()
            # the decay matrix once; dγ's terms by where the kernel sums them: rows of [64, K]
            # products (dg_k), rows (dg_t) and columns (dg_c) of [64, 64] ones
            lower = (o[:, None] >= o[None, :]) & valid[:, None]
            dec = torch.exp(torch.where(lower, g[:, None] - g[None, :], float("-inf")))
            dsm = dod * dec * scale
            dqs = dqs * (scale * torch.exp(g))[:, None]
            dg_k = (tq * dqs).sum(1)
            dq = dsm.to(dt).float() @ tk + dqs
            dks = dks * torch.exp(g_last - g)[:, None]
            a = (tk * dks).sum(1)
            dg_k = dg_k - a
            tail = a.sum() + torch.exp(torch.tensor(g_last)) * gcs
            dk = dsm.to(dt).float().T @ tq + dks
            e = (tq @ tk.T) * dsm
            dg_t, dg_c = e.sum(1), -e.sum(0)
            bg = b * torch.exp(g)
            tdw = tt @ dW
            ktdw = (tk * tdw).sum(1)
            dk = dk + tdw * bg[:, None]
            db = ktdw * torch.exp(g) + dbu
            dg_k = dg_k + ktdw * bg
            strict = lower & (o[:, None] != o[None, :])
            da = tt @ hi + tt @ lo
            da = -torch.where(strict, da * dec, torch.zeros(()))
            kk = tk @ tk.T
            db = (da * kk).sum(1) + db
            m = da * b[:, None]
            e2 = m * kk
            dg_t = dg_t + e2.sum(1)
            dg_c = dg_c - e2.sum(0)
            dg_c[n - 1] += tail
            dg = dg_c + (dg_t + dg_k)
            mr = m.to(dt).float()
            dk = dk + mr @ tk + mr.T @ tk
            after = o[None, :] >= o[:, None]
            DQ[t0:t0 + n, i_hv] = dq[:n]
            DK[t0:t0 + n, i_hv] = dk[:n]
            DB[t0:t0 + n, i_hv] = db[:n]
            DG[t0:t0 + n, i_hv] = torch.where(after, dg[None, :], torch.zeros(())).sum(1)[:n]
    return DQ.to(grad_dtype), DK.to(grad_dtype), DV.to(dv_dtype or grad_dtype), DG, DB


def _as_backward(*args):
    """The transcription in fused_bwd.backward's form: the outputs, allocated, and ``run``, which fills
    them (the whole call's chunks at once: the cases here are too small to be sliced)."""
    q, v, ch, grad_dtype, dv_dtype = args[0], args[2], args[11], args[13], args[14]
    T, HV, K, V = q.shape[0], v.shape[1], q.shape[2], v.shape[2]
    outs = (torch.empty(T, HV, K, dtype=grad_dtype), torch.empty(T, HV, K, dtype=grad_dtype),
            torch.empty(T, HV, V, dtype=dv_dtype or grad_dtype), torch.empty(T, HV), torch.empty(T, HV))

    def run(chunk_idx, rows, NT):
        assert NT == ch.NT and torch.equal(rows, common.chunk_rows(ch, rows.device))
        for o, x in zip(outs, transcription(*args)):
            o.copy_(x)

    return outs, run


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("K,V", [(32, 64), (64, 32)])
def test_fused_backward_math(dtype, K, V, monkeypatch):
    """Packed with an empty, a one-token and a partial sequence, grouped value heads, an initial
    state: the transcription in the backward gives the reference's gradients, and the chunk op
    launches neither dqk nor wy_bwd then."""
    from gdn.ops.delta.triton import chunk_bwd, fused_bwd

    monkeypatch.setitem(tuning.DELTA, "fused_bwd", dict(tuning.DELTA["fused_bwd"], on=True))
    monkeypatch.setattr(fused_bwd, "usable", lambda *a: True)
    monkeypatch.setattr(fused_bwd, "backward", _as_backward)
    launches = _record_launches(monkeypatch, chunk_bwd)
    errs = _run_both("gated_delta_rule", B=1, T=194, H=1, HV=2, K=K, V=V, dtype=dtype, lens=[65, 1, 0, 128], seed=19)
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, bad
    names = [name for name, _ in launches]
    assert "dqk_kernel" not in names and "wy_bwd_kernel" not in names, names


def test_fused_backward_launch():
    """fused_bwd.backward's launch as recorded (nothing runs): one program per chunk and value head,
    the kernel's compile-time arguments and 8 warps, outputs of the caller's dtypes."""
    from gdn.ops.delta.triton import fused_bwd
    from gdn.ops.triton import common
    from gdn.ops.triton import launch as L

    T, H, HV, K, V = 130, 1, 2, 64, 64
    ch = common.make_chunks(1, T, None, torch.device("cpu"))
    bf = torch.bfloat16
    q, v = torch.zeros(T, H, K, dtype=bf), torch.zeros(T, HV, V, dtype=bf)
    G, beta, Ai = torch.zeros(T, HV), torch.zeros(T, HV), torch.zeros(T, HV, 64, dtype=bf)
    h = torch.zeros(ch.NT, HV, K, V, dtype=bf)
    with L.recording() as rec:
        (DQ, DK, DV, DG, DB), run = fused_bwd.backward(q, q, v, G, beta, Ai, v, v, h, h, v, ch, 0.125, torch.float32,
                                                       bf)
        run(ch.chunk_idx, common.chunk_rows(ch, ch.cu.device), ch.NT)
    assert [(kern.fn.__name__, tuple(grid)) for kern, grid, _, _ in rec] == [("fused_bwd_kernel", (ch.NT * HV,))]
    meta = rec[0][3]
    c = tuning.DELTA["fused_bwd"]
    assert (meta["K"], meta["V"], meta["BV"], meta["NS"], meta["num_warps"]) == (K, V, c["BV"], c["NS"], 8)
    assert DQ.dtype == DK.dtype == torch.float32 and DV.dtype == bf and DG.dtype == DB.dtype == torch.float32
    # fp32 dQ and dK leave through masked stores, dV in the inputs' dtype by tensor copies
    assert (meta["QK_TMA"], meta["DV_TMA"]) == (False, True)
    # its twelve descriptor arguments (q, k, T⁻¹, δ, dO, dδ, v, h, dh in; dQ, dK, dV out, the first
    # two standing in for q's and k's here), set field by field (the base unreshaped, its [rows, ·]
    # shape worked out), equal what Gluon's checked constructor makes of the reshaped base
    descs = [a for a in rec[0][2] if isinstance(a, fused_bwd.TensorDescriptor)]
    assert len(descs) == 12
    names = fused_bwd.fused_bwd_kernel.arg_names
    args = dict(zip(names, rec[0][2]))
    assert args["dq_t"] is args["q_t"] and args["dk_t"] is args["k_t"] and args["dv_t"].base is DV
    for d in descs:
        want = fused_bwd.TensorDescriptor.from_tensor(d.base.view(d.shape), d.block_shape, d.layout)
        assert [list(d.shape), list(d.strides), d.block_shape, d.layout, d.padding] == [
            list(want.shape), list(want.strides), want.block_shape, want.layout, want.padding], (vars(d), vars(want))
        assert d.base.data_ptr() == want.base.data_ptr() and d.base.dtype == want.base.dtype
        assert d.block_shape in ([64, c["BV"]], [K, c["BV"]], [64, K], [64, 64]) and d.base.is_contiguous()


def test_fused_backward_launch_items(monkeypatch):
    """``DELTA["fused_bwd"]["items"]`` consecutive items a program: ⌈chunks · HV / items⌉ programs, the
    count as the kernel's PER, the number of items as its run-time NW (the last group partial)."""
    from gdn.ops.delta.triton import fused_bwd
    from gdn.ops.triton import common
    from gdn.ops.triton import launch as L

    T, H, HV, K, V = 330, 1, 3, 64, 64  # 6 chunks, 18 items
    ch = common.make_chunks(1, T, None, torch.device("cpu"))
    bf = torch.bfloat16
    q, v = torch.zeros(T, H, K, dtype=bf), torch.zeros(T, HV, V, dtype=bf)
    G, beta, Ai = torch.zeros(T, HV), torch.zeros(T, HV), torch.zeros(T, HV, 64, dtype=bf)
    h = torch.zeros(ch.NT, HV, K, V, dtype=bf)
    for items, programs in ((1, 18), (4, 5)):
        monkeypatch.setitem(tuning.DELTA, "fused_bwd", dict(tuning.DELTA["fused_bwd"], items=items))
        with L.recording() as rec:
            _, run = fused_bwd.backward(q, q, v, G, beta, Ai, v, v, h, h, v, ch, 0.125, bf, bf)
            run(ch.chunk_idx, common.chunk_rows(ch, ch.cu.device), ch.NT)
        (kern, grid, args, meta), = rec
        assert tuple(grid) == (programs,) and meta["PER"] == items
        assert dict(zip(kern.arg_names, args))["NW"] == ch.NT * HV == 18


@pytest.mark.parametrize("K,grad_dtype,dv_dtype", [(64, torch.bfloat16, torch.bfloat16), (64, torch.float32, None),
                                                   (32, torch.bfloat16, torch.float32)])
def test_fused_backward_writes_over_inputs(K, grad_dtype, dv_dtype):
    """dV takes dδ's storage and dQ δ's wherever shape and dtype match (each program reads its rows
    of both before writing them), and fresh tensors otherwise."""
    from gdn.ops.delta.triton import fused_bwd
    from gdn.ops.triton import common
    from gdn.ops.triton import launch as L

    T, H, HV, V = 130, 1, 2, 64
    ch = common.make_chunks(1, T, None, torch.device("cpu"))
    bf = torch.bfloat16
    q, v, do = torch.zeros(T, H, K, dtype=bf), torch.zeros(T, HV, V, dtype=bf), torch.zeros(T, HV, V, dtype=bf)
    VN, DD = torch.zeros(T, HV, V, dtype=bf), torch.zeros(T, HV, V, dtype=bf)
    G, beta, Ai = torch.zeros(T, HV), torch.zeros(T, HV), torch.zeros(T, HV, 64, dtype=bf)
    h = torch.zeros(ch.NT, HV, K, V, dtype=bf)
    with L.recording():
        (DQ, DK, DV, _, _), _ = fused_bwd.backward(q, q, v, G, beta, Ai, VN, do, h, h.clone(), DD, ch, 0.125,
                                                   grad_dtype, dv_dtype)
    assert (DQ.data_ptr() == VN.data_ptr()) == (K == V and grad_dtype == bf)
    assert (DV.data_ptr() == DD.data_ptr()) == ((dv_dtype or grad_dtype) == bf)
    assert DQ.shape == DK.shape == (T, HV, K) and DV.shape == (T, HV, V)
    assert DQ.dtype == DK.dtype == grad_dtype and DV.dtype == (dv_dtype or grad_dtype)
    assert DK.data_ptr() not in (VN.data_ptr(), DD.data_ptr(), DQ.data_ptr(), DV.data_ptr())


def test_value_tile_and_usable_rules(monkeypatch):
    """The value tile: the setting's width where it divides V, else 32, else none (the pair runs);
    the kernel is taken only for gated delta members on a CUDA device (never on the CPU)."""
    from gdn.ops.delta.triton import fused_bwd

    monkeypatch.setitem(tuning.DELTA, "fused_bwd", dict(tuning.DELTA["fused_bwd"], BV=64, on=True))
    assert [fused_bwd.value_tile(V) for V in (128, 256, 96, 32, 48)] == [64, 64, 32, 32, 0]
    q, g, beta = torch.zeros(4, 1, 64, dtype=torch.bfloat16), torch.zeros(4, 1), torch.zeros(4, 1)
    assert not fused_bwd.usable(q, g, beta, 64, 64)  # a CPU tensor


def test_backward_without_gluon(monkeypatch):
    """A triton without Gluon: the fused module does not import, the chunk op's backward runs the
    pair (dqk, wy_bwd) and gives the reference's gradients."""
    import sys

    from gdn.ops.delta.triton import chunk_bwd

    monkeypatch.setitem(tuning.DELTA, "fused_bwd", dict(tuning.DELTA["fused_bwd"], on=True))
    from gdn.ops.delta import triton as package

    monkeypatch.setitem(sys.modules, "gdn.ops.delta.triton.fused_bwd", None)  # import raises ImportError
    monkeypatch.delattr(package, "fused_bwd", raising=False)  # (an earlier import left it on the package)
    chunk_bwd._fused_bwd.cache_clear()  # (the getter keeps its first answer; cleared again below)
    try:
        assert chunk_bwd._fused_bwd() is None
        launches = _record_launches(monkeypatch, chunk_bwd)
        errs = _run_both("gated_delta_rule", B=1, T=130, H=1, HV=2, K=32, V=32, dtype=torch.float16, lens=None,
                         seed=23)
    finally:
        chunk_bwd._fused_bwd.cache_clear()
    bad = {k: v for k, v in errs.items() if not v <= TOL[torch.float16]}
    assert not bad, bad
    names = [name for name, _ in launches]
    assert "dqk_kernel" in names and "wy_bwd_kernel" in names, names
