"""The one routing rule of gdn.ops.router: which implementation runs a call."""
from __future__ import annotations

import pytest
import torch

from gdn import ops
from gdn.ops import router, tuning


def _qkv(T=100, K=16, V=16, dtype=torch.float32, grad=False):
    q = torch.randn(1, T, 2, K, dtype=dtype, requires_grad=grad)
    k = torch.randn(1, T, 2, K, dtype=dtype)
    v = torch.randn(1, T, 2, V, dtype=dtype)
    return q, k, v


def test_cpu_picks_recurrence_for_decode_and_chunk_otherwise():
    q, k, v = _qkv()
    assert router.route("op", None, q, k, v, decode_step=False, grad=False) == "chunk"
    assert router.route("op", None, q, k, v, decode_step=True, grad=False) == "naive"
    assert router.route("op", "naive", q, k, v, decode_step=False, grad=True) == "naive"
    assert router.route("op", "chunk", q, k, v, decode_step=True, grad=False) == "chunk"


def test_explicit_triton_on_cpu_raises_naming_the_op():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend='triton' cannot run my_op"):
        router.route("my_op", "triton", q, k, v, decode_step=False, grad=False)


@pytest.mark.parametrize("T,K,V,dtype,grad,kda,want", [
    (100, 128, 128, torch.bfloat16, False, False, "triton-chunk"),  # prefill
    (1, 128, 128, torch.bfloat16, False, False, "triton-recurrent"),  # decode step
    (tuning.RECURRENT_MAX_T, 16, 16, torch.float32, False, False, "triton-recurrent"),  # short prefill
    (tuning.RECURRENT_MAX_T + 1, 16, 16, torch.float32, False, False, "triton-chunk"),
    (1, 128, 128, torch.bfloat16, True, False, "triton-chunk"),  # training, however short
    (1, 16, 16, torch.float64, False, False, "triton-chunk"),  # fp64: the recurrent kernel takes half/fp32
    (100, 16, 300, torch.float32, True, True, "triton-recurrent"),  # KDA: V beyond its chunk kernels
])
def test_triton_rule(monkeypatch, T, K, V, dtype, grad, kda, want):
    """The rule on a CUDA device with Triton (simulated: it reads only shapes, dtypes, gradients)."""
    monkeypatch.setattr(router, "use_triton", lambda x: True)
    q, k, v = _qkv(T, K, V, dtype, grad)
    got = router.route("op", None, q, k, v, decode_step=T == 1, grad=router.needs_grad(q, k, v), kda=kda)
    assert got == want
    assert router.route("op", "triton", q, k, v, decode_step=T == 1, grad=router.needs_grad(q, k, v), kda=kda) == want


def test_public_ops_follow_the_router(monkeypatch):
    """Every recurrent op asks the router and runs what it names (here forced to the spec)."""
    calls = []
    real = router.route

    def spy(op, backend, *a, **kw):
        calls.append(op)
        return real(op, "naive", *a, **kw)

    monkeypatch.setattr(ops, "route", spy)
    q, k, v = _qkv(T=5)
    g, beta = -torch.rand(1, 5, 2), torch.rand(1, 5, 2)
    ops.linear_attention(q, k, v)
    ops.gated_delta_rule(q, k, v, g, beta)
    ops.kimi_delta_attention(q, k, v, g[..., None].expand(1, 5, 2, 16), beta)
    assert calls == ["linear_attention", "gated_delta_rule", "kimi_delta_attention"]


def test_needs_grad_and_available_backends():
    x = torch.zeros(2, requires_grad=True)
    assert router.needs_grad(None, x) and not router.needs_grad(None, x.detach())
    with torch.no_grad():
        assert not router.needs_grad(x)
    assert router.available_backends("cpu") == ["naive", "chunk"]


def test_heads_wider_than_the_kernels_take(monkeypatch):
    """K (or, for the scalar-gate family, V) beyond tuning.MAX_HEAD_DIM: the chunk form on the GPU,
    and a clear error when Triton is asked for."""
    monkeypatch.setattr(router, "use_triton", lambda x: True)
    wide = tuning.MAX_HEAD_DIM * 2
    for K, V, kda in ((wide, 16, False), (16, wide, False), (wide, 16, True)):
        q, k, v = _qkv(8, K, V)
        assert router.route("op", None, q, k, v, decode_step=False, grad=False, kda=kda) == "chunk"
        assert router.route("op", None, q[:, :1], k[:, :1], v[:, :1], decode_step=True, grad=False, kda=kda) == "naive"
        with pytest.raises(ValueError, match=f"heads of at most {tuning.MAX_HEAD_DIM}"):
            router.route("op", "triton", q, k, v, decode_step=False, grad=False, kda=kda)


@pytest.mark.parametrize("backend", [None, "naive"])
def test_packed_call_with_as_many_tokens_as_sequences_is_no_decode_step(backend):
    """Three tokens in three packed sequences, one of them empty and one of two tokens: not a decode
    step; the result equals running each sequence alone."""
    from gdn.ops.delta import reference as R

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 3, 2, 8, dtype=torch.float64) for _ in range(3))
    g, beta = -torch.rand(1, 3, 2, dtype=torch.float64), torch.rand(1, 3, 2, dtype=torch.float64)
    cu = torch.tensor([0, 0, 2, 3])
    o, S = ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True, backend=backend)
    for n, (s, e) in enumerate(((0, 0), (0, 2), (2, 3))):
        if e > s:
            o_n, S_n = R.gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                          output_final_state=True)
            assert torch.allclose(o[:, s:e], o_n, atol=1e-12)
            assert torch.allclose(S[n], S_n[0], atol=1e-12)
    assert router.decode_step(3, cu) is False and router.decode_step(3, torch.tensor([0, 1, 2, 3])) is True
