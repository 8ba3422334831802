"""The math of the Gluon forward pass (gdn.ops.delta.triton.fused_fwd), which has no interpreter: a
PyTorch transcription of its kernel, step for step (the same products, masks, decays and operands
rounded to the input dtype), put in its place in the chunk op's forward on the CPU, gives the
float64 reference's outputs and final state (and the backward, which recomputes its own states,
the reference's gradients). The kernel's launch as recorded, and its sm_90 compile
(tests/test_gluon_budget.py); the GPU test (tests/gpu/test_fused_fwd.py) checks the kernel itself."""
from __future__ import annotations

import pytest
import torch

from gdn.ops import tuning

from .test_triton_chunk import TOL, _record_launches, _run_both

BT = 64


def transcription(q, k, v, G, beta, Ai, pairs, h0, o, ht, ch, scale):
    """fused_fwd.forward's writes (o and ht), computed per sequence, value head, value tile and
    chunk as fused_fwd_kernel does: fp32 accumulation, S, X and δ rounded to the input dtype as
    MMA operands, δ̃ rounded after its decay. Rows past the chunk's sequence are left out, as the
    kernel masks them."""
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    BV = tuning.DELTA["fused_fwd"]["BV"]
    dt, f32 = v.dtype, torch.float32
    cu = ch.cu.tolist()
    for n in range(len(cu) - 1):
        bos, eos = cu[n], cu[n + 1]
        for i_hv in range(HV):
            i_h = i_hv // (HV // H)
            for v0 in range(0, V, BV):
                cols = slice(v0, v0 + BV)
                S = h0[n, i_hv, :, cols].float() if h0 is not None else torch.zeros(K, BV)
                for t0 in range(bos, eos, BT):
                    r = slice(t0, min(t0 + BT, eos))
                    nr = r.stop - r.start
                    g, g_last = G[r, i_hv], G[r.stop - 1, i_hv]
                    Sd = S.to(dt).to(f32)
                    kf = k[r, i_h].float()
                    X = kf @ Sd
                    OQ = q[r, i_h].float() @ Sd
                    Xs = ((v[r, i_hv, cols].float() - X * torch.exp(g)[:, None]) * beta[r, i_hv][:, None]).to(dt)
                    d = (Ai[r, i_hv, :nr].float() @ Xs.float()).to(dt).float()
                    e = (d * torch.exp(g_last - g)[:, None]).to(dt).float()
                    O = pairs[r, i_hv, :nr].float() @ d + OQ * torch.exp(g)[:, None]
                    S = S * torch.exp(g_last) + kf.T @ e
                    o[r, i_hv, cols] = (O * scale).to(o.dtype)
                if ht is not None:
                    ht[n, i_hv, :, cols] = S


def _use_transcription(monkeypatch):
    from gdn.ops.delta.triton import fused_fwd

    calls = []

    def run(*args):
        calls.append(args)
        return transcription(*args)

    monkeypatch.setitem(tuning.DELTA, "fused_fwd", dict(tuning.DELTA["fused_fwd"], on=True))
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], warm=False))
    # the fused pass, which the Gluon one replaces, even where its programs would not fill the card
    monkeypatch.setitem(tuning.DELTA, "state_out", dict(tuning.DELTA["state_out"], fill=0))
    monkeypatch.setattr(fused_fwd, "usable", lambda q, g, beta, K, V, split: not split)
    monkeypatch.setattr(fused_fwd, "forward", run)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("K,V", [(32, 64), (64, 128)])
def test_fused_forward_math(dtype, K, V, monkeypatch):
    """Packed with an empty, a one-token and a partial sequence, grouped value heads, an initial
    state: the transcription in the forward gives the reference's o, final state and gradients,
    and the chunk op launches no state_out pass then."""
    from gdn.ops.delta.triton import chunk_fwd

    calls = _use_transcription(monkeypatch)
    launches = _record_launches(monkeypatch, chunk_fwd)
    errs = _run_both("gated_delta_rule", B=1, T=194, H=1, HV=2, K=K, V=V, dtype=dtype, lens=[65, 1, 0, 128], seed=23)
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, bad
    assert calls and "state_out_kernel" not in [name for name, _ in launches]


def test_fused_forward_launch(monkeypatch):
    """fused_fwd.forward's launch as recorded (nothing runs): one program per value tile and
    (sequence, value head), the kernel's compile-time settings, descriptors of one chunk's rows
    equal to what Gluon's checked constructor makes."""
    from gdn.ops.delta.triton import fused_bwd, fused_fwd
    from gdn.ops.triton import common
    from gdn.ops.triton import launch as L

    T, H, HV, K, V = 130, 1, 2, 64, 128
    ch = common.make_chunks(1, T, None, torch.device("cpu"))
    bf = torch.bfloat16
    q, v = torch.zeros(T, H, K, dtype=bf), torch.zeros(T, HV, V, dtype=bf)
    G, beta, Ai = torch.zeros(T, HV), torch.zeros(T, HV), torch.zeros(T, HV, BT, dtype=bf)
    o, ht = torch.empty(T, HV, V, dtype=bf), torch.empty(1, HV, K, V)
    with L.recording() as rec:
        fused_fwd.forward(q, q, v, G, beta, Ai, Ai, None, o, ht, ch, 0.125)
    c = tuning.DELTA["fused_fwd"]
    assert [(kern.fn.__name__, tuple(grid)) for kern, grid, _, _ in rec] == [("fused_fwd_kernel",
                                                                             (V // c["BV"], HV))]
    meta = rec[0][3]
    assert (meta["K"], meta["V"], meta["BV"], meta["NS"], meta["num_warps"]) == (K, V, c["BV"], c["NS"],
                                                                                  c["num_warps"])
    assert meta["USE_INIT"] is False and meta["STORE_FINAL"] is True
    descs = [a for a in rec[0][2] if isinstance(a, fused_bwd.TensorDescriptor)]
    assert [d.block_shape for d in descs] == [[BT, K], [BT, K], [BT, c["BV"]], [BT, BT], [BT, BT]]
    for d in descs:
        want = fused_bwd.TensorDescriptor.from_tensor(d.base, d.block_shape, d.layout)
        assert vars(d) == vars(want)


def test_usable_rules(monkeypatch):
    """Off by default; never on CPU tensors, in fp32, for other members or under a split."""
    from gdn.ops.delta.triton import fused_fwd

    assert tuning.DELTA["fused_fwd"]["on"] is False
    monkeypatch.setitem(tuning.DELTA, "fused_fwd", dict(tuning.DELTA["fused_fwd"], on=True))
    q, g, beta = torch.zeros(4, 1, 64, dtype=torch.bfloat16), torch.zeros(4, 1), torch.zeros(4, 1)
    assert not fused_fwd.usable(q, g, beta, 64, 128, False)  # a CPU tensor
    assert not fused_fwd.usable(q, None, beta, 64, 128, False)
