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

from .helpers import rel_err  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET was set in this process", allow_module_level=True)

from gdn.ops.triton import gemv as kernels  # noqa: E402

#: Relative error bound against float64: fp32 accumulation in another order (a few ulp of the sum);
#: fp16 adds one rounding of the output (and of h in the SwiGLU form), ulp 2**-11 relative.
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3}


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
    assert rel_err(got, F.linear(x.double(), w.double())) < BOUND[dtype]


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
    assert rel_err(got, F.linear(h, w.double())) < BOUND[dtype]


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("with_delta", [False, True])
def test_norm_gemv_against_norm_then_linear(dtype, M, with_delta):
    """The residual add, the RMSNorm and the projection in one pass (two K tiles and a masked tail):
    the stream s bit-equal to x + delta rounded, the product within the bound of the separate norm
    (rounded to the dtype) times the weight in float64; without delta s is x itself."""
    from gdn.ops.norm import add_rms_norm, rms_norm

    K, N = 300, 24
    gen = torch.Generator().manual_seed(M + 10 * with_delta)
    x = (2 * torch.randn(M, 1, K, generator=gen)).to(dtype)
    d = (2 * torch.randn(M, 1, K, generator=gen)).to(dtype) if with_delta else None
    wn = (1 + 0.1 * torch.randn(K, generator=gen)).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype)
    s, y = kernels.norm_gemv(x, d, wn, 1e-6, w)
    if with_delta:
        s_ref, h = add_rms_norm(x, d, wn, 1e-6, dtype)  # CPU tensors: the PyTorch ops
        assert torch.equal(s, s_ref)
    else:
        h = rms_norm(x, wn, 1e-6, dtype)
        assert s is x
    assert y.shape == (M, 1, N) and y.dtype == dtype
    assert rel_err(y, F.linear(h.double(), w.double())) < BOUND[dtype] * 2


def test_norm_linear_routes(monkeypatch):
    """Few rows in the norm's dtype take the one-pass kernel; a wider norm dtype, more rows or a
    gradient take the norm's ops and decode_linear (same results on the CPU)."""
    monkeypatch.setattr(gemv_ops, "use_triton", lambda x: True)
    calls = []
    monkeypatch.setattr(kernels, "norm_gemv", lambda *a: calls.append(1) or (a[0], None))
    monkeypatch.setattr(kernels, "gemv", lambda x, w, up: torch.zeros(*x.shape[:-1], w.shape[0]))
    x, wn, w = torch.randn(2, 1, 16), torch.ones(16), torch.randn(8, 16)
    with torch.no_grad():
        gemv_ops.norm_linear(x, None, wn, 1e-6, w, torch.float32)
        assert calls == [1]
        gemv_ops.norm_linear(x, x, wn, 1e-6, w.double(), torch.float64)  # the norm (and weight) in another dtype
        gemv_ops.norm_linear(torch.randn(5, 1, 16), None, wn, 1e-6, w, torch.float32)  # five rows
        assert calls == [1]
    s, y = gemv_ops.norm_linear(x, x, wn.requires_grad_(), 1e-6, w, torch.float32)
    assert calls == [1] and y.requires_grad and torch.equal(s, x + x)
