"""Softmax attention through SDPA against the explicit masked reference."""
from __future__ import annotations

import pytest
import torch

import gdn.ops as ops

from .helpers import rel_err


def _qkv(B, T, HQ, HKV, K, V, dtype=torch.float64, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HQ, K, generator=gen, dtype=dtype).requires_grad_(grad)
    k = torch.randn(B, T, HKV, K, generator=gen, dtype=dtype).requires_grad_(grad)
    v = torch.randn(B, T, HKV, V, generator=gen, dtype=dtype).requires_grad_(grad)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_sdpa_matches_reference(causal, heads):
    q, k, v = _qkv(2, 33, *heads, 16, 12)
    o = ops.softmax_attention(q, k, v, causal=causal)
    o_ref = ops.softmax_attention(q, k, v, causal=causal, backend="naive")
    assert o.shape == (2, 33, heads[0], 12)
    assert rel_err(o, o_ref) < 1e-12


@pytest.mark.parametrize("window,T", [(1, 20), (5, 300), (200, 700), (1000, 50)])
def test_sliding_window_matches_reference(window, T):
    q, k, v = _qkv(1, T, 4, 2, 8, 8, grad=True)
    o = ops.softmax_attention(q, k, v, window_size=window)
    o_ref = ops.softmax_attention(q, k, v, window_size=window, backend="naive")
    assert rel_err(o, o_ref) < 1e-12
    w = torch.randn_like(o)
    ga = torch.autograd.grad((o * w).sum(), (q, k, v))
    gb = torch.autograd.grad((o_ref * w).sum(), (q, k, v))
    for a, b in zip(ga, gb):
        assert rel_err(a, b) < 1e-10


def test_window_of_one_returns_own_value():
    q, k, v = _qkv(1, 10, 2, 2, 4, 4)
    assert rel_err(ops.softmax_attention(q, k, v, window_size=1), v) < 1e-14


@pytest.mark.parametrize("window", [None, 4])
def test_packed_attention_equals_separate(window):
    cu = torch.tensor([0, 7, 7, 30, 31])
    q, k, v = _qkv(1, 31, 4, 2, 8, 8)
    o = ops.softmax_attention(q, k, v, cu_seqlens=cu, window_size=window)
    o_ref = ops.softmax_attention(q, k, v, cu_seqlens=cu, window_size=window, backend="naive")
    assert rel_err(o, o_ref) < 1e-12
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e > s:
            part = ops.softmax_attention(q[:, s:e], k[:, s:e], v[:, s:e], window_size=window)
            assert rel_err(o[:, s:e], part) < 1e-14


def test_attention_bad_inputs():
    q, k, v = _qkv(1, 8, 3, 2, 4, 4)
    with pytest.raises(ValueError, match="HQ = 3"):
        ops.softmax_attention(q, k, v)
    q, k, v = _qkv(1, 8, 4, 2, 4, 4)
    with pytest.raises(ValueError, match="window_size"):
        ops.softmax_attention(q, k, v, window_size=0)
    with pytest.raises(ValueError, match="causal"):
        ops.softmax_attention(q, k, v, window_size=2, causal=False)
    with pytest.raises(ValueError, match="k must have shape"):
        ops.softmax_attention(q, k[:, :5], v)
    with pytest.raises(ValueError, match="triton"):
        ops.softmax_attention(q, k, v, backend="triton")
