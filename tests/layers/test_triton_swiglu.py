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


def test_swiglu_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="up must match gate"):
        swiglu_forward(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="dh must match gate"):
        swiglu_backward(torch.zeros(4, dtype=torch.float16), torch.zeros(4), torch.zeros(4))
