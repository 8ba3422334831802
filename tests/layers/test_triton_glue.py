"""The Triton short convolution and RMSNorm passes (gdn.ops.triton.short_conv, .rmsnorm) against the
PyTorch Functions of gdn.ops.conv / gdn.ops.norm, on the CPU through Triton's interpreter.

Every output and gradient (x, weight, history, gate) against the PyTorch path run in float64 on
the same inputs: fp32 within ~1e-5, fp16 within a few 1e-3 (bf16 is checked on the GPU by
tests/gpu/test_glue.py). Shapes are awkward on purpose: T ∈ {1, 3, 5, 130}, D ∈ {7, 64, 100},
packed sequences with a one-token and an empty member.

TRITON_INTERPRET must be set before triton is first imported in the process; if an earlier
module imported triton with it unset (and there is no GPU) the module is skipped.
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

from gdn.ops.conv import ConvActFn as _ConvActFn  # noqa: E402
from gdn.ops.norm import GatedRMSNormFn as _GatedRMSNormFn
from gdn.ops.norm import RMSNormFn as _RMSNormFn  # noqa: E402
from gdn.ops.triton.rmsnorm import add_rms_norm, gated_rms_norm, rms_norm  # noqa: E402
from gdn.ops.triton.short_conv import short_conv  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def _check_conv(B, T, D, K, activation, with_hist, dtype, lens=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen).to(dtype)
    w = torch.randn(D, K, generator=gen) / K
    h = torch.randn(B, D, K - 1, generator=gen).to(dtype) if with_hist else None
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    dy = torch.randn(B, T, D, generator=gen).to(dtype)

    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    ht = h.clone().requires_grad_() if with_hist else None
    y = short_conv(xt, wt, ht, cu, activation)
    assert y.dtype == dtype and y.shape == x.shape
    y.backward(dy)

    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    hr = h.double().requires_grad_() if with_hist else (None if lens is not None else torch.zeros(B, D, K - 1).double())
    yr = _ConvActFn.apply(xr, wr, hr, cu, activation)
    yr.backward(dy.double())

    pairs = [("y", y, yr), ("dx", xt.grad, xr.grad), ("dw", wt.grad, wr.grad)]
    if with_hist:
        pairs.append(("dhist", ht.grad, hr.grad))
        assert ht.grad.dtype == dtype
    assert xt.grad.dtype == dtype and wt.grad.dtype == torch.float32
    for name, got, want in pairs:
        err = _rel(got, want)
        assert err <= TOL[dtype], (name, err)


@pytest.mark.parametrize("T", [1, 3, 5])
@pytest.mark.parametrize("D", [7, 64, 100])
@pytest.mark.parametrize("with_hist", [True, False])
def test_conv_short_sequences(T, D, with_hist):
    _check_conv(2, T, D, 4, "silu" if (T + D) % 2 else None, with_hist, torch.float32, seed=T * D)


@pytest.mark.parametrize("D,activation,with_hist", [(100, "silu", True), (7, None, False), (64, "silu", False)])
def test_conv_long_sequence(D, activation, with_hist):
    _check_conv(2, 130, D, 4, activation, with_hist, torch.float32)


@pytest.mark.parametrize("lens,D,activation", [([3, 1, 0, 60], 100, "silu"), ([1, 0, 2], 7, None),
                                               ([0, 5, 1], 64, "silu")])
def test_conv_packed(lens, D, activation):
    _check_conv(1, sum(lens), D, 4, activation, False, torch.float32, lens=lens)


@pytest.mark.parametrize("K", [1, 2, 3])
def test_conv_kernel_sizes(K):
    _check_conv(2, 9, 7, K, "silu", K > 1, torch.float32)
    _check_conv(1, 9, 7, K, None, False, torch.float32, lens=[4, 0, 1, 4])


@pytest.mark.parametrize("T,D,activation,with_hist,lens", [
    (130, 64, "silu", True, None), (5, 7, None, False, None), (1, 100, "silu", True, None), (7, 7, "silu", False, [1, 0, 6])])
def test_conv_fp16(T, D, activation, with_hist, lens):
    _check_conv(1 if lens else 2, T, D, 4, activation, with_hist, torch.float16, lens=lens)


def test_conv_matches_the_module_semantics_without_grad():
    """Under no_grad the conv still runs (no autograd graph needed) and equals the reference."""
    x, w = torch.randn(2, 6, 7), torch.randn(7, 4)
    with torch.no_grad():
        y = short_conv(x, w, None, None, "silu")
        ref = _ConvActFn.apply(x, w, torch.zeros(2, 7, 3), None, "silu")
    assert _rel(y, ref.double()) <= 1e-6


@pytest.mark.parametrize("lens", [None, [5, 1, 0, 60]], ids=["history", "packed"])
def test_conv_reads_a_column_block_in_place(lens):
    """x a column block of a wider tensor (a mixer's joined projections): read at its strides, with
    the results and gradients of its contiguous copy, bit for bit."""
    gen = torch.Generator().manual_seed(7)
    B = 1 if lens else 2
    T = sum(lens) if lens else 70
    wide = torch.randn(B, T, 100, generator=gen)
    w = torch.randn(40, 4, generator=gen) / 4
    h = None if lens else torch.randn(B, 40, 3, generator=gen)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    dy = torch.randn(B, T, 40, generator=gen)
    outs = []
    for block in (lambda t: t[..., 30:70], lambda t: t[..., 30:70].contiguous()):
        xt = wide.clone().requires_grad_()
        x = block(xt)
        assert x.is_contiguous() == (len(outs) == 1)
        y = short_conv(x, w, h, cu, "silu")
        y.backward(dy)
        outs.append((y, xt.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("lens,with_hist,sizes", [(None, False, [32, 32, 96]), (None, True, [32, 32, 96]),
                                                   ([5, 1, 0, 60], False, [32, 32, 96]), (None, False, [48, 80])],
                         ids=["plain", "history", "packed", "two"])
def test_conv_group_is_the_convolutions_one_by_one(lens, with_hist, sizes):
    """Two or three convolutions over adjacent column blocks of one product run as one: the outputs
    (each its own contiguous tensor), the product's gradient (the blocks' dx written in place in the
    split's buffer), the weights' and the histories' gradients are those of the convolutions run
    one by one: bit for bit but for dw, whose fp32 partials may be summed in another order (the
    group's channel blocks are aligned to its bounds, so its tiles can be narrower)."""
    from gdn.ops.joined import split_columns
    from gdn.ops.triton.short_conv import short_conv_group

    gen = torch.Generator().manual_seed(11)
    B = 1 if lens else 2
    T = sum(lens) if lens else 70
    wide = torch.randn(B, T, sum(sizes) + 16, generator=gen)
    ws = [torch.randn(n, 4, generator=gen) / 4 for n in sizes]
    hs = [torch.randn(B, n, 3, generator=gen) for n in sizes] if with_hist else [None] * len(sizes)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    dys = [torch.randn(B, T, n, generator=gen) for n in sizes]
    outs = []
    for group in (True, False):
        yt = wide.clone().requires_grad_()
        wl = [w.clone().requires_grad_() for w in ws]
        hl = [None if h is None else h.clone().requires_grad_() for h in hs]
        xs = split_columns(yt, sizes + [16])[:len(sizes)]
        if group:
            ys = short_conv_group(xs, wl, torch.cat(hl, 1) if with_hist else None, cu, "silu")
            assert ys is not None and all(y.is_contiguous() and y.shape == x.shape for y, x in zip(ys, xs))
        else:
            ys = [short_conv(x, w, h, cu, "silu") for x, w, h in zip(xs, wl, hl)]
        sum((y * d).sum() for y, d in zip(ys, dys)).backward()
        outs.append([*ys, yt.grad, *[w.grad for w in wl]] + ([h.grad for h in hl] if with_hist else []))
    n = len(sizes)
    for i, (a, b) in enumerate(zip(*outs)):
        if n + 1 <= i < 2 * n + 1:  # dw
            assert _rel(a, b.double()) < 1e-6, i
        else:
            assert torch.equal(a, b), i


def test_conv_group_places_dx_and_declines_what_it_cannot_join(monkeypatch):
    """The group's dx lands in the joined product's gradient buffer (no copy by the split); inputs
    that are not side by side, not aligned to 16 channels, or of other kernel sizes are declined
    (None: the caller runs the convolutions one by one)."""
    from gdn.ops.joined import split_columns
    from gdn.ops.triton.short_conv import short_conv_group
    from tests.joined_spy import record_placed

    placed = record_placed(monkeypatch)
    y = torch.randn(2, 9, 112, requires_grad=True)
    q, k, v, rest = split_columns(y, [32, 32, 32, 16])
    ws = [torch.randn(32, 4) for _ in range(3)]
    outs = short_conv_group((q, k, v), ws, None, None, "silu")
    sum(o.sum() for o in outs).backward()
    assert placed == [[True, True, True, False]], placed
    z = torch.randn(2, 9, 112)
    assert short_conv_group((z[..., :32], z[..., 48:80]), ws[:2], None, None, "silu") is None  # a gap
    assert short_conv_group((z[..., 32:64], z[..., :32]), ws[:2], None, None, "silu") is None  # out of order
    assert short_conv_group((z[..., :40], z[..., 40:72]), [torch.randn(40, 4), ws[0]], None, None, "silu") is None
    assert short_conv_group((z[..., :32], z[..., 32:64]), [ws[0], torch.randn(32, 3)], None, None, "silu") is None
    assert short_conv_group((z[..., :32], z[..., 32:64]), ws[:2], None, None, "silu") is not None


def test_conv_rejects_bad_input():
    x, w = torch.zeros(1, 4, 8), torch.zeros(8, 4)
    with pytest.raises(ValueError, match="weight must have shape"):
        short_conv(x, torch.zeros(7, 4))
    with pytest.raises(ValueError, match="hist must have shape"):
        short_conv(x, w, torch.zeros(1, 8, 2))
    with pytest.raises(ValueError, match="hist cannot be combined"):
        short_conv(x, w, torch.zeros(1, 8, 3), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="B == 1"):
        short_conv(torch.zeros(2, 4, 8), w, None, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="activation"):
        short_conv(x, w, activation="relu")
    with pytest.raises(ValueError, match="T ≥ 1"):
        short_conv(torch.zeros(1, 0, 8), w)
    with pytest.raises(TypeError, match="fp16, bf16 or fp32"):
        short_conv(x.double(), w)


def _check_norm(shape, gated, dtype, out_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    D = shape[-1]
    x = (2 * torch.randn(shape, generator=gen)).to(dtype)
    g = (2 * torch.randn(shape, generator=gen)).to(dtype)
    w = 1 + 0.5 * torch.randn(D, generator=gen)
    out = out_dtype or dtype
    dy = torch.randn(shape, generator=gen).to(out)

    xt, gt, wt = x.clone().requires_grad_(), g.clone().requires_grad_(), w.clone().requires_grad_()
    y = gated_rms_norm(xt, gt, wt, 1e-6) if gated else rms_norm(xt, wt, 1e-6, out_dtype)
    assert y.dtype == out and y.shape == x.shape
    y.backward(dy)

    xr, gr, wr = x.double().requires_grad_(), g.double().requires_grad_(), w.double().requires_grad_()
    yr = _GatedRMSNormFn.apply(xr, gr, wr, 1e-6) if gated else _RMSNormFn.apply(xr, wr, 1e-6, torch.float64)
    yr.backward(dy.double())

    pairs = [("y", y, yr), ("dx", xt.grad, xr.grad), ("dw", wt.grad, wr.grad)]
    if gated:
        pairs.append(("dgate", gt.grad, gr.grad))
        assert gt.grad.dtype == dtype
    assert xt.grad.dtype == dtype and wt.grad.dtype == torch.float32
    for name, got, want in pairs:
        err = _rel(got, want)
        assert err <= TOL[torch.float16 if torch.float16 in (dtype, out) else torch.float32], (name, err)


@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 64), (2, 70, 100), (300, 7)])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norms(shape, gated, dtype):
    _check_norm(shape, gated, dtype)


def test_rms_norm_out_dtype():
    """The autocast behaviour of RMSNorm: fp32 input, half output (the statistics stay fp32)."""
    _check_norm((4, 9, 64), False, torch.float32, out_dtype=torch.float16)


@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 64), (2, 70, 100)])
@pytest.mark.parametrize("x_dtype,h_dtype,out_dtype", [(torch.float32, torch.float32, None),
                                                       (torch.float32, torch.float16, torch.float16),
                                                       (torch.float16, torch.float16, None)])
@pytest.mark.parametrize("used", ["both", "norm", "stream"])
def test_add_rms_norm_with_gradients(shape, x_dtype, h_dtype, out_dtype, used):
    """The residual add and the norm after it (the training block's x + h, then mlp_norm), one
    kernel each way, against the two ops in float64: s, y and the gradients of x, h and the weight
    (in their own dtypes), with the stream, the norm or both read downstream."""
    gen = torch.Generator().manual_seed(len(shape))
    D = shape[-1]
    x = (2 * torch.randn(shape, generator=gen)).to(x_dtype)
    h = torch.randn(shape, generator=gen).to(h_dtype)
    w = 1 + 0.5 * torch.randn(D, generator=gen)
    out = out_dtype or x_dtype
    ds = torch.randn(shape, generator=gen).to(x_dtype)
    dy = torch.randn(shape, generator=gen).to(out)

    def loss(s, y):
        return ((s.double() * ds.double()).sum() if used != "norm" else 0) + \
            ((y.double() * dy.double()).sum() if used != "stream" else 0)

    xt, ht, wt = x.clone().requires_grad_(), h.clone().requires_grad_(), w.clone().requires_grad_()
    s, y = add_rms_norm(xt, ht, wt, 1e-6, out_dtype)
    assert s.dtype == x_dtype and y.dtype == out and s.shape == y.shape == x.shape
    loss(s, y).backward()
    xr, hr, wr = x.double().requires_grad_(), h.double().requires_grad_(), w.double().requires_grad_()
    sr = xr + hr
    yr = _RMSNormFn.apply(sr, wr, 1e-6, torch.float64)
    loss(sr, yr).backward()
    assert xt.grad.dtype == x_dtype and ht.grad.dtype == h_dtype and wt.grad.dtype == torch.float32
    pairs = [("s", s, sr), ("y", y, yr), ("dx", xt.grad, xr.grad), ("dh", ht.grad, hr.grad)]
    if used != "stream":
        pairs.append(("dw", wt.grad, wr.grad))
    else:
        assert wt.grad is None or not wt.grad.any()
    for name, got, want in pairs:
        err = _rel(got, want)
        assert err <= TOL[torch.float16 if torch.float16 in (x_dtype, h_dtype, out) else torch.float32], (name, err)


def test_add_rms_norm_rejects_a_wider_h():
    with pytest.raises(ValueError, match="dtype that x's"):
        add_rms_norm(torch.zeros(3, 8, dtype=torch.float16), torch.zeros(3, 8), torch.ones(8))


def test_norms_reject_bad_input():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(3, 8), torch.ones(7))
    with pytest.raises(ValueError, match="gate must have the shape"):
        gated_rms_norm(torch.zeros(3, 8), torch.zeros(3, 7), torch.ones(8))
    with pytest.raises(TypeError, match="fp16, bf16 or fp32"):
        rms_norm(torch.zeros(3, 8, dtype=torch.float64), torch.ones(8))


def test_mixer_on_the_kernels_with_joined_projections(monkeypatch):
    """A Gated DeltaNet layer with every op on its Triton kernels (interpreted): the joined input
    projections hand the convolutions, the gate kernel and the gated norm column blocks of one
    product; the output and every gradient are those of the layers called one by one."""
    import sys

    from gdn.layers import GatedDeltaNet

    for name, mod in list(sys.modules.items()):
        if name.startswith("gdn.") and hasattr(mod, "use_triton"):
            monkeypatch.setattr(mod, "use_triton", lambda x: True)
    from gdn.ops.triton import short_conv as conv_kernels

    strided = []
    real = conv_kernels._conv_fwd
    monkeypatch.setattr(conv_kernels, "_conv_fwd", lambda x, *a: strided.append(not x.is_contiguous()) or real(x, *a))
    torch.manual_seed(0)
    m = GatedDeltaNet(32, 2, 16, num_v_heads=4, expand_v=1.5).train()
    x = torch.randn(2, 20, 32)
    dy = torch.randn(2, 20, 32)
    from tests.joined_spy import record_placed

    placed = record_placed(monkeypatch)  # per backward of a split: blocks written in place
    res = []
    for joined in (True, False):
        monkeypatch.setattr("gdn.layers.recurrent.joinable", (lambda mods: True) if joined else (lambda mods: False))
        m.zero_grad()
        xt = x.clone().requires_grad_()
        o, _ = m(xt)
        o.backward(dy)
        res.append([o.detach(), xt.grad] + [p.grad.clone() for p in m.parameters()])
    # q, k, v read in place from the joined product by one convolution over their channels; one
    # convolution each when the projections are separate tensors
    assert strided == [True] + [False] * 3, strided
    # the joined product's gradient (blocks q, k, v, g, then the narrow a and b, then the padding):
    # the convolutions' dx (q, k, v) and the gated norm's dgate (g) written in place by their
    # kernels; the gate inputs a and b (and the padding) are not
    assert placed == [[True, True, True, True, False, False, False]], placed
    monkeypatch.setattr("gdn.layers.recurrent.joinable", lambda mods: True)
    blocks = m.project(x)
    assert blocks["q_proj"].stride(1) % 8 == 0  # the product's rows
    assert all(b.storage_offset() % 8 == 0 for b in blocks.values() if b.shape[-1] % 8 == 0)
    assert min(b.storage_offset() for b in blocks.values() if b.shape[-1] % 8) > blocks["g_proj"].storage_offset()
    for (name, _), a, b in zip([("o", 0), ("dx", 0)] + list(m.named_parameters()), *res):
        assert _rel(a, b.double()) < 1e-5, (name, _rel(a, b.double()))


@pytest.mark.parametrize("shape", [(1, 1), (3, 6), (1025, 7), (16384, 6), (40, 1030), (0, 5), (4, 0), (300, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_colsum_is_the_sum_over_rows(shape, dtype, monkeypatch):
    """gdn.ops.triton.colsum: Σ over rows in fp32 for any [P, D] (one row, a non-power-of-two and a
    wide D, many rows of few columns, empty; rows split over programs past ``ROWS``, here 64, then
    the splits' sums added), a strided input copied first, the same at every call."""
    from gdn.ops.triton import colsum as C

    monkeypatch.setattr(C, "ROWS", 64)
    colsum = C.colsum

    x = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = colsum(x)
    assert got.dtype == torch.float32 and got.shape == (shape[1],)
    want = x.double().sum(0)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4), (got - want).abs().max()
    assert torch.equal(colsum(x), got)
    if shape[0] > 1:
        assert torch.allclose(colsum(x.t().contiguous().t()).double(), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="colsum: x must be"):
        colsum(x[None])
