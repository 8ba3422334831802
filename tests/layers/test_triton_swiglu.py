"""The Triton SwiGLU passes (gdn.ops.triton.swiglu) against PyTorch, on the CPU through Triton's
interpreter (fp32, fp16; bf16 is checked on the GPU by tests/gpu/test_glue.py)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from gdn.ops.tuning import INTERPRET  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET was set in this process", allow_module_level=True)

from gdn.ops.triton.swiglu import swiglu_backward, swiglu_forward  # noqa: E402


@pytest.mark.parametrize("shape", [(3, 5, 7), (2049,), (0, 4)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_swiglu_passes_match_pytorch(shape, dtype, tol):
    gen = torch.Generator().manual_seed(0)
    g = (3 * torch.randn(shape, generator=gen)).to(dtype)
    u = torch.randn(shape, generator=gen).to(dtype)
    dh = torch.randn(shape, generator=gen).to(dtype)
    gd, ud = g.double().requires_grad_(), u.double().requires_grad_()
    ref = F.silu(gd) * ud
    ref.backward(dh.double())
    h = swiglu_forward(g, u)
    dg, du = swiglu_backward(dh, g, u)
    assert h.dtype == dg.dtype == du.dtype == dtype and h.shape == g.shape
    for got, want in ((h, ref), (dg, gd.grad), (du, ud.grad)):
        err = (got.double() - want).norm() / want.norm().clamp_min(1e-30)
        assert err <= tol, err
    # the backward forming the product as well: the forward's product and the same gradients, bit for bit
    dg2, du2, h2 = swiglu_backward(dh, g, u, want_h=True)
    assert torch.equal(h2, h) and torch.equal(dg2, dg) and torch.equal(du2, du)


def test_swiglu_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="up must match gate"):
        swiglu_forward(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="dh must match gate"):
        swiglu_backward(torch.zeros(4, dtype=torch.float16), torch.zeros(4), torch.zeros(4))


@pytest.mark.parametrize("lead", [(3, 5), (4,), (2, 3, 2)])
def test_swiglu_backward_into_the_joined_gradient(lead):
    """gate and up as the column blocks of one product [..., 2I]: the backward writes both
    gradients into the blocks of one tensor of that layout (in place, or through a packed copy for
    a layout the rows do not take), equal to the packed pass's; nothing else of it is written."""
    gen = torch.Generator().manual_seed(1)
    I = 6
    gu = torch.randn(*lead, 2 * I, generator=gen)
    if len(lead) == 3:  # a permuted view: three row levels, which the kernels take through a copy
        gu = gu.transpose(0, 1)
    gate, up = gu.chunk(2, -1)
    dh = torch.randn(gate.shape, generator=gen)
    want = swiglu_backward(dh, gate.contiguous(), up.contiguous())
    out = torch.full_like(gu, float("nan"))  # (with gu's strides)
    dg, du = swiglu_backward(dh, gate, up, out=out.chunk(2, -1))
    assert dg.data_ptr() == out.data_ptr() and du.data_ptr() == out.data_ptr() + I * out.element_size()
    assert torch.equal(out, torch.cat(want, -1))
    out2 = torch.full_like(gu, float("nan"))
    *_, h = swiglu_backward(dh, gate, up, out=out2.chunk(2, -1), want_h=True)
    assert torch.equal(out2, out) and torch.equal(h, swiglu_forward(gate.contiguous(), up.contiguous()))
    with pytest.raises(ValueError, match="strides"):
        swiglu_backward(dh, gate, up, out=(torch.empty(gate.shape), torch.empty(up.shape)))
