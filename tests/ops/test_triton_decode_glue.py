"""The decode step's fused glue kernels under Triton's interpreter, against the PyTorch step they
replace: the short-convolution step (tails rolled in place, dot, bias, SiLU in one launch).

fp32: the products and the oldest-first sum are those of the PyTorch step, so the pre-activation and
the rolled tails are bit-equal; SiLU's exp is the interpreter's (numpy) against PyTorch's own
vectorised one, so the activated output is within a few ulp. fp16: the kernel sums in fp32 and
rounds once where PyTorch rounds the products and the sum, so within one rounding.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from gdn.ops.tuning import INTERPRET  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET was set in this process", allow_module_level=True)

from gdn.ops import conv as conv_ops  # noqa: E402
from gdn.ops.triton import short_conv as conv_kernels  # noqa: E402

#: Tolerances of one output against the PyTorch step, (rtol, atol) per dtype: a few fp32 ulp; in fp16
#: one rounding of PyTorch's partial sums (below 16 in size here, ulp 2**-7) before the bias cancels.
CLOSE = {torch.float32: (4e-7, 1e-7), torch.float16: (2e-3, 8e-3)}


def _product(dtype, seed, batch, width):
    """A [batch, 1, width] product (the decode step's joined projections), scaled so SiLU sees both
    signs and large values."""
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(batch, 1, width, generator=gen)).to(dtype)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("K", [4, 2, 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", ["silu", None])
def test_conv_step_kernel(dtype, K, bias, act):
    """A column slice of a product (read in place) through the kernel: the PyTorch step's output
    (bit-equal in fp32 without the activation) and its rolled tails, bit for bit, in place."""
    B, D = 3, 40
    p = _product(dtype, K, B, 57)
    x = p[..., 5:5 + D]
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(D, K, generator=gen).to(dtype)
    b = torch.randn(D, generator=gen).to(dtype) if bias else None
    tails = torch.randn(B, D, K - 1, generator=gen).to(dtype)
    t_ref = tails.clone()
    want = conv_ops.conv_step_(x, w, t_ref, act, b)  # CPU tensors: the PyTorch step
    ptr = tails.data_ptr()
    got = conv_kernels.conv_step_(x, w, tails, act, b)
    assert tails.data_ptr() == ptr and torch.equal(tails, t_ref)
    assert got.is_contiguous() and got.dtype == dtype and got.shape == (B, 1, D)
    if dtype == torch.float32 and act is None:
        assert torch.equal(got, want)
    else:
        rtol, atol = CLOSE[dtype]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_conv_step_routes_to_kernel(monkeypatch):
    """gdn.ops.conv.conv_step_ takes the kernel exactly where use_triton says so (CPU tensors here
    when told to), and its PyTorch form otherwise."""
    calls = []
    real = conv_kernels.conv_step_
    monkeypatch.setattr(conv_kernels, "conv_step_", lambda *a: calls.append(1) or real(*a))
    x, w, t = torch.randn(2, 1, 8), torch.randn(8, 4), torch.randn(2, 8, 3)
    conv_ops.conv_step_(x, w, t.clone(), "silu")
    assert not calls
    monkeypatch.setattr(conv_ops, "use_triton", lambda x: True)
    conv_ops.conv_step_(x, w, t.clone(), "silu")
    assert calls == [1]
