"""The Triton row passes of the chunked cross entropy (gdn.ops.triton.cross_entropy) against
PyTorch, on the CPU through Triton's interpreter (fp32, fp16; bf16 on the GPU: tests/gpu/test_glue.py)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from gdn.ops.tuning import INTERPRET  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET was set in this process", allow_module_level=True)

from gdn.ops.triton.cross_entropy import logsumexp_pick, softmax_grad  # noqa: E402


@pytest.mark.parametrize("R,V", [(5, 7), (3, 5000), (1, 4096)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_row_passes_match_pytorch(R, V, dtype, tol):
    gen = torch.Generator().manual_seed(1)
    z = (4 * torch.randn(R, V, generator=gen)).to(dtype)
    t = torch.randint(0, V, (R,), generator=gen)
    coef = torch.randn(R, generator=gen)
    zd = z.double()
    lse, picked = logsumexp_pick(z, t)
    assert torch.allclose(lse.double(), torch.logsumexp(zd, -1), rtol=1e-6, atol=1e-5)
    assert torch.equal(picked, z.float().gather(1, t[:, None])[:, 0])
    ref = torch.softmax(zd, -1)
    ref[torch.arange(R), t] -= 1
    ref *= coef.double()[:, None]
    dz = softmax_grad(z, lse, t, coef)
    assert dz.dtype == dtype and dz.shape == z.shape
    err = (dz.double() - ref).norm() / ref.norm()
    assert err <= tol, err


def test_lse_of_minus_inf_lanes_is_finite():
    """Rows shorter than a block and very negative logits give a finite log-sum-exp."""
    z = torch.full((2, 3), -1e30)
    z[1, 2] = 0.0
    lse, _ = logsumexp_pick(z, torch.tensor([0, 2]))
    assert torch.isfinite(lse).all() and abs(lse[1].item()) < 1e-6


def test_row_passes_reject_bad_targets():
    with pytest.raises(ValueError, match="target must be an integer tensor"):
        logsumexp_pick(torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(ValueError, match="z must be a"):
        logsumexp_pick(torch.zeros(3), torch.zeros(3, dtype=torch.long))
