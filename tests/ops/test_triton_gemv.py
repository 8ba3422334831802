"""The decode products' streaming kernel (:mod:`gdn.ops.triton.gemv`) under Triton's interpreter,
against ``F.linear`` in float64: one to four rows, widths that are and are not multiples of the
tiles, rows read in place from a column slice of a wider product, and the SwiGLU form (SiLU(gate) ·
up formed per tile). Also which products :func:`gdn.ops.gemv.decode_linear` sends to it.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from gdn.ops import gemv as gemv_ops  # noqa: E402
from gdn.ops.tuning import INTERPRET  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET was set in this process", allow_module_level=True)

from gdn.ops.triton import gemv as kernels  # noqa: E402

#: Relative error bound against float64: fp32 accumulation in another order (a few ulp of the sum);
#: fp16 adds one rounding of the output (and of h in the SwiGLU form), ulp 2**-11 relative.
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("N,K", [(40, 96), (300, 200), (7, 1000)])
def test_gemv_against_linear(dtype, M, N, K):
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    wide = torch.randn(M, 1, K + 30, generator=gen).to(dtype)
    x = wide[..., 10:10 + K]  # rows at the wider product's stride, read in place
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype)
    got = kernels.gemv(x, w)
    assert got.shape == (M, 1, N) and got.dtype == dtype
    assert _rel(got, F.linear(x.double(), w.double())) < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3])
def test_gemv_swiglu_form(dtype, M):
    """gate and up as column slices of one product (the decode step's joined MLP projection)."""
    K, N = 176, 48
    gen = torch.Generator().manual_seed(M)
    p = (2 * torch.randn(M, 1, 2 * K, generator=gen)).to(dtype)
    gate, up = p[..., :K], p[..., K:]
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype)
    h = (F.silu(gate.double()) * up.double()).to(dtype).double()  # h rounded to the input dtype, as the kernel
    got = kernels.gemv(gate, w, up)
    assert got.shape == (M, 1, N)
    assert _rel(got, F.linear(h, w.double())) < BOUND[dtype]


def test_tiles_spread_short_outputs():
    """A short output (1024 columns) still makes at least twice as many programs as multiprocessors;
    a long one takes the widest column blocks; a tile holds the configured element count."""
    cpu = torch.device("cpu")  # 4 "multiprocessors" off CUDA
    BN, BK = kernels.tiles(1024, 2816, cpu)
    assert BN == 16 and BN * BK == 4096
    for N in (24, 100, 5000):
        BN, BK = kernels.tiles(N, 1024, cpu)
        assert BN >= 1 and (N + BN - 1) // BN >= min(N, 8) and BK >= 64


def test_decode_linear_routes(monkeypatch):
    """Few rows without a gradient take the kernel; more rows, a gradient or another dtype take
    F.linear (and the SwiGLU form swiglu_down)."""
    monkeypatch.setattr(gemv_ops, "use_triton", lambda x: True)
    calls = []
    monkeypatch.setattr(kernels, "gemv", lambda x, w, up: calls.append(up is not None) or torch.zeros(1))
    w = torch.randn(8, 16)
    with torch.no_grad():
        gemv_ops.decode_linear(torch.randn(4, 1, 16), w)
        gemv_ops.decode_linear(torch.randn(1, 1, 16), w, torch.randn(1, 1, 16))
        assert calls == [False, True]
        out = gemv_ops.decode_linear(torch.randn(5, 1, 16), w)
        assert out.shape == (5, 1, 8) and calls == [False, True]
        with pytest.raises(RuntimeError):  # dtypes differ: PyTorch's product, which refuses them
            gemv_ops.decode_linear(torch.randn(1, 1, 16).half(), w)
    xg = torch.randn(1, 1, 16, requires_grad=True)
    assert gemv_ops.decode_linear(xg, w).requires_grad and calls == [False, True]
