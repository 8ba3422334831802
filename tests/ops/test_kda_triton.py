"""Tier 3 on the CPU: the token-recurrent Triton KDA kernels under the Triton interpreter against
the float64 recurrence (forward, decode with a state, packed sequences, backward through the
checkpointed reverse pass), and the op's choice between them and the chunk kernels (those are
tested in tests/ops/test_kda_triton_chunk.py)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from gdn.ops import tuning  # noqa: E402
from gdn.ops.kda import reference as KR  # noqa: E402
from gdn.ops.kda.triton import recurrent as TK  # noqa: E402

from .helpers import rel_err  # noqa: E402
from .test_kda import kda_inputs  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _cast(d, dtype):
    return {n: (x.to(torch.float32 if n == "initial_state" else dtype) if x is not None else None)
            for n, x in d.items()}


def _call(mod, d, **kw):
    fn = TK.recurrent_kda if mod is TK else mod.kimi_delta_attention
    return fn(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                    output_final_state=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(2, 1, 1, 2, 16, 16), (1, 21, 1, 2, 20, 70), (1, 9, 2, 4, 32, 24)],
                         ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_reference(shape, dtype):
    B, T, H, HV, K, V = shape
    d = _cast(kda_inputs(B, T, H, HV, K, V), dtype)
    o, S = _call(TK, d)
    o_ref, S_ref = _call(KR, {n: x.double() for n, x in d.items()})
    assert o.dtype == dtype and S.dtype == torch.float32
    assert rel_err(o, o_ref) < TOL[dtype] and rel_err(S, S_ref) < 1e-5


def test_packed_and_no_state():
    d = kda_inputs(1, 30, 1, 2, 16, 16, N=3, dtype=torch.float32)
    cu = torch.tensor([0, 17, 17, 30])
    o, S = _call(TK, d, cu_seqlens=cu)
    o_ref, S_ref = _call(KR, {n: x.double() for n, x in d.items()}, cu_seqlens=cu)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5
    o2, S2 = TK.recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"])
    assert S2 is None and rel_err(o2, KR.kimi_delta_attention(d["q"], d["k"], d["v"], d["g"], d["beta"])[0]) < 1e-5


@pytest.mark.parametrize("cu", [None, [0, 7, 7, 20]], ids=["dense", "packed"])
def test_backward_matches_reference(cu):
    """Gradients of q, k, v, g, beta and the initial state, across several checkpoint stretches
    (T > CK) and V tiles (V > BV)."""
    B = 1
    N = 3 if cu is not None else 1
    d = kda_inputs(B, 20, 1, 2, 16, 72, N=N, dtype=torch.float32, requires_grad=True)
    cu_t = torch.tensor(cu) if cu is not None else None
    names = ("q", "k", "v", "g", "beta", "initial_state")
    gen = torch.Generator().manual_seed(3)
    w_o, w_s = torch.randn(1, 20, 2, 72, generator=gen), torch.randn(N, 2, 16, 72, generator=gen)
    grads = []
    for mod, dd in ((TK, d), (KR, {n: x.double() for n, x in d.items()})):
        o, S = _call(mod, dd, cu_seqlens=cu_t)
        loss = (o * w_o.to(o.dtype)).sum() + (S * w_s.to(S.dtype)).sum()
        grads.append(torch.autograd.grad(loss, [dd[n] for n in names]))
    for name, a, b in zip(names, *grads):
        assert rel_err(a, b) < 1e-5, name


@pytest.mark.parametrize("T,cu,grad,V,want", [
    (1, None, False, 16, "triton-recurrent"),  # decode step
    (tuning.RECURRENT_MAX_T, None, False, 16, "triton-recurrent"),  # short prefill without gradients
    (tuning.RECURRENT_MAX_T + 1, None, False, 16, "triton-chunk"),  # prefill
    (2, None, True, 16, "triton-chunk"),  # training, however short
    (40, [0, 20, 20, 40], False, 16, "triton-recurrent"),  # packed, 40 tokens in all
    (100, [0, 64, 64, 100], False, 16, "triton-chunk"),  # packed, 100 tokens in all
    (100, None, True, 300, "triton-recurrent"),  # V beyond the chunk kernels
])
def test_router_picks_kda_kernels(monkeypatch, T, cu, grad, V, want):
    """The router's rule for KDA on a CUDA device with Triton (simulated: the rule reads only the
    call's shapes, dtypes and gradient needs)."""
    from gdn.ops import router

    monkeypatch.setattr(router, "use_triton", lambda x: True)
    N = 1 if cu is None else len(cu) - 1
    d = kda_inputs(1, T, 1, 1, 16, V, N=N, dtype=torch.float32, requires_grad=grad)
    got = router.route("kimi_delta_attention", None, d["q"], d["k"], d["v"], decode_step=T == N, kda=True,
                       grad=router.needs_grad(*d.values()))
    assert got == want
