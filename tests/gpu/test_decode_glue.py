"""The decode step's fused glue kernels on the GPU at decode shapes (batch 1 and 32, 340m widths),
against the PyTorch step run in float64 on the same inputs: the short-convolution step
(:func:`gdn.ops.triton.short_conv.conv_step_`), the residual add inside the RMSNorm after it
(:func:`gdn.ops.triton.rmsnorm.add_rms_norm`) and the Gated DeltaNet step from its raw inputs
(:func:`gdn.ops.delta.triton.pool.fused_gated_delta_rule_step_`).

Outputs are relative RMS errors (bound: 1e-5 in fp32, 1e-2 in bf16, where one rounding is ≈ 2e-3
and a wrong kernel O(1)); what the kernels copy or roll (tails, residual streams) must be exact.
"""
from __future__ import annotations

import pytest
import torch

from gdn.ops import conv as conv_ops
from gdn.ops.triton.short_conv import conv_step_

from .helpers import DEVICE, dtype_id, rel_err

DTYPES = (torch.float32, torch.bfloat16)
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
H, K, HV, V = 8, 128, 8, 128  # the 340m Gated DeltaNet heads


def _product(batch, width, dtype, seed, device=DEVICE):
    gen = torch.Generator(device=device).manual_seed(seed)
    return (2 * torch.randn(batch, 1, width, device=device, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_step(batch, dtype, bias, device=DEVICE):
    """q, k, v's channels of the joined product through one launch: output against the float64
    PyTorch step, tails rolled exactly, in place."""
    D = 2 * H * K + HV * V
    p = _product(batch, D + 2 * HV + HV * V, dtype, batch, device)
    x = p[..., :D]
    gen = torch.Generator(device=device).manual_seed(1)
    w = (0.5 * torch.randn(D, 4, device=device, generator=gen)).to(dtype)
    b = torch.randn(D, device=device, generator=gen).to(dtype) if bias else None
    tails = torch.randn(batch, D, 3, device=device, generator=gen).to(dtype)
    t64 = tails.double()
    want = conv_ops.conv_step_(x.double().cpu(), w.double().cpu(), t64.cpu(), "silu",
                               None if b is None else b.double().cpu())
    expect_tails = torch.cat([tails[..., 1:], x.transpose(1, 2)], -1)
    ptr = tails.data_ptr()
    got = conv_step_(x, w, tails, "silu", b)
    assert got.dtype == dtype and got.is_contiguous() and tails.data_ptr() == ptr
    assert torch.equal(tails, expect_tails)
    assert rel_err(got, want.to(device)) <= BOUND[dtype]
    if x.is_cuda:  # the layers' entry point takes the same kernel on CUDA
        t2 = expect_tails.clone()
        assert torch.equal(conv_ops.conv_step_(x, w, t2, "silu", b), conv_step_(x, w, expect_tails.clone(), "silu", b))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("batch", [1, 32])
def test_add_rms_norm(batch, dtype, device=DEVICE):
    """The residual add inside the norm: the stream bit-equal to PyTorch's add, the normed rows
    bit-equal to the RMSNorm kernel on that stream and within bounds of the float64 norm."""
    from gdn.ops.norm import norm_forward
    from gdn.ops.triton.rmsnorm import add_rms_norm, rms_norm
    D = 1024
    x = _product(batch, D, dtype, 3, device)
    h = _product(batch, D, dtype, 4, device)
    w = 1 + 0.5 * torch.randn(D, device=device, generator=torch.Generator(device=device).manual_seed(5))
    s, y = add_rms_norm(x, h, w, 1e-6)
    assert torch.equal(s, x + h) and s.dtype == dtype and y.dtype == dtype
    assert torch.equal(y, rms_norm(s, w, 1e-6))
    want, _ = norm_forward(s.double(), None, w.double(), 1e-6, torch.float64)
    assert rel_err(y, want) <= BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("neg", [False, True])
def test_fused_gdn_step(batch, dtype, neg, device=DEVICE):
    """The Gated DeltaNet step from its raw inputs in one launch (L2 norms, gate, β inside the
    recurrent kernel; q, k, v, a, b column slices of one product): output and in-place state
    against the float64 PyTorch step, and within the same bounds of the prologue kernels + step."""
    from gdn import ops
    from gdn.ops.delta.triton.pool import fused_gated_delta_rule_step_, fused_recurrent_step_
    from gdn.ops.delta.triton.prologue import prologue
    widths = [H * K, H * K, HV * V, HV, HV]
    p = _product(batch, sum(widths) + 8, dtype, 11, device)
    q, k, v, a, b = p[..., :sum(widths)].split(widths, -1)
    q, k, v = q.view(batch, 1, H, K), k.view(batch, 1, H, K), v.view(batch, 1, HV, V)
    gen = torch.Generator(device=device).manual_seed(12)
    A_log = torch.randn(HV, device=device, generator=gen)
    dt_bias = torch.randn(HV, device=device, generator=gen)
    state = torch.randn(batch, HV, K, V, device=device, generator=gen)
    s64 = state.double().cpu()
    want = ops.gated_delta_rule_fused_step_(*(t.double().cpu() for t in (q, k, v, a, b, A_log, dt_bias)), s64,
                                            allow_neg_eigval=neg, backend="naive")
    s_sep, s_got = state.clone(), state.clone()
    ptr = s_got.data_ptr()
    qn, kn, g, beta = prologue(q, k, a, b, A_log, dt_bias, True, neg)
    sep = fused_recurrent_step_(qn, kn, v, g, beta, s_sep)
    got = fused_gated_delta_rule_step_(q, k, v, a, b, A_log, dt_bias, s_got, allow_neg_eigval=neg)
    assert got.dtype == dtype and s_got.data_ptr() == ptr
    for name, x, ref in (("o", got, want), ("state", s_got, s64), ("o (separate)", sep, want),
                         ("state (separate)", s_sep, s64)):
        assert rel_err(x, ref.to(device)) <= BOUND[dtype], name
    if p.is_cuda:  # the op takes the fused step on CUDA
        s_op = state.clone()
        o_op = ops.gated_delta_rule_fused_step_(q, k, v, a, b, A_log, dt_bias, s_op, allow_neg_eigval=neg)
        assert torch.equal(o_op, got) and torch.equal(s_op, s_got)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("N,K", [(4620, 1024), (1024, 1536), (5632, 1024), (1024, 2816), (32000, 1024)])
def test_gemv(M, N, K, dtype, device=DEVICE):
    """The decode products of one to four rows (gdn.ops.triton.gemv) at the 340m layer's shapes, rows
    read in place from a wider product, against float64; the SwiGLU form at the down projection's."""
    from gdn.ops.triton.gemv import gemv

    gen = torch.Generator(device=device).manual_seed(M + N + K)
    p = torch.randn(M, 1, 2 * K + 8, device=device, generator=gen).to(dtype)
    w = (torch.randn(N, K, device=device, generator=gen) / K ** 0.5).to(dtype)
    x = p[..., 8:8 + K]
    got = gemv(x, w)
    assert got.shape == (M, 1, N) and got.dtype == dtype
    assert rel_err(got, x.double() @ w.double().t()) < BOUND[dtype]
    up = p[..., 8 + K:]
    h = (torch.nn.functional.silu(x.double()) * up.double()).to(dtype).double()
    assert rel_err(gemv(x, w, up), h @ w.double().t()) < BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("N", [4620, 5632])
def test_norm_gemv(M, N, with_delta, dtype, device=DEVICE):
    """A residual add, the RMSNorm and the projection after it in one pass at the 340m widths: the
    stream exact, the product against the float64 norm and product."""
    from gdn.ops.triton.gemv import norm_gemv

    K = 1024
    gen = torch.Generator(device=device).manual_seed(M + N)
    x = (2 * torch.randn(M, 1, K, device=device, generator=gen)).to(dtype)
    d = (2 * torch.randn(M, 1, K, device=device, generator=gen)).to(dtype) if with_delta else None
    wn = (1 + 0.1 * torch.randn(K, device=device, generator=gen)).to(dtype)
    w = (torch.randn(N, K, device=device, generator=gen) / K ** 0.5).to(dtype)
    s, y = norm_gemv(x, d, wn, 1e-6, w)
    s_ref = x if d is None else (x.float() + d.float()).to(dtype)
    assert torch.equal(s, s_ref)
    s64 = s_ref.double()
    h = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6) * wn.double()
    assert rel_err(y, h @ w.double().t()) < BOUND[dtype]
