"""The glue kernels on rows with a stride (gdn.ops.triton.rows), under Triton's interpreter.

RMSNorm (plain and gated), SwiGLU and the prologue's L2 norm and gate read views whose last dim is
contiguous and whose rows are strided (a column slice of a wider product, its per-head view, an
expanded row) in place. The arithmetic is that of a packed copy of the same values, so every
output and gradient must equal the kernel's on ``x.contiguous()`` bit for bit, and the layout must
be the strided one (no copy made). Layouts the kernels do not read are copied.
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

from gdn.ops.delta.triton.prologue import Gate, L2Norm, Prologue, prologue  # noqa: E402
from gdn.ops.triton.rmsnorm import gated_rms_norm, rms_norm  # noqa: E402
from gdn.ops.triton.rows import rows  # noqa: E402
from gdn.ops.triton.swiglu import swiglu_backward, swiglu_forward  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
B, H, K, WIDTH = 5, 3, 16, 3 * 48 + 29  # the product's width: no multiple of the slices' widths


def _product(dtype, seed, batch=B):
    """A [batch, 1, WIDTH] leaf (the joined projections of a decode step), scaled so SiLU and the
    gates see both signs and large values."""
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(batch, 1, WIDTH, generator=gen)).to(dtype).requires_grad_()


def _slice(p, start, width):
    return p[..., start:start + width]


def _heads(p, start):
    """Per-head view [B, 1, H, K] of a column slice: two strided row levels."""
    return _slice(p, start, H * K).view(*p.shape[:2], H, K)


def _packed(*xs):
    """Contiguous leaf copies of ``xs``."""
    return [x.detach().contiguous().requires_grad_() for x in xs]


def _eq(name, got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert torch.equal(got, want), (name, (got.double() - want.double()).abs().max().item())


def test_rows_layouts():
    p = torch.zeros(B, 1, WIDTH)
    r = rows(p)
    assert not r.strided and r.t is p and r.args() == (B, 0, WIDTH)
    r = rows(_slice(p, 7, 40))  # one level: rows at the product's width
    assert r.strided and r.t.data_ptr() == p.data_ptr() + 7 * 4 and r.args() == (B, 0, WIDTH)
    r = rows(_heads(p, 11))  # two levels: heads at stride K inside rows at stride WIDTH
    assert r.strided and r.args() == (H, WIDTH, K)
    r = rows(torch.zeros(1, 32).expand(B, 32))  # one row read B times
    assert r.strided and r.args() == (B, 0, 0)
    r = rows(_slice(torch.zeros(1, 1, WIDTH), 3, 40))  # one row: contiguous as it is
    assert not r.strided
    for bad in (p.transpose(0, 2), torch.zeros(4, 6, 5, WIDTH)[::2, ::2, ::2, :8]):  # last dim strided; three levels
        r = rows(bad)
        assert not r.strided and r.t.is_contiguous() and torch.equal(r.t, bad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [False, True])
def test_rms_norm_strided_rows_bit_equal(dtype, heads):
    p = _product(dtype, 1)
    x = _heads(p, 5) if heads else _slice(p, 5, H * K)
    w = torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(2)).requires_grad_()
    assert rows(x).strided
    y = rms_norm(x, w, 1e-6, torch.float32)
    xc, = _packed(x)
    wc = w.detach().clone().requires_grad_()
    yc = rms_norm(xc, wc, 1e-6, torch.float32)
    _eq("y", y, yc)
    assert y.is_contiguous()
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    y.backward(dy)
    yc.backward(dy)
    _eq("dx", p.grad[..., 5:5 + H * K].reshape(xc.shape), xc.grad)
    _eq("dw", w.grad, wc.grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_strided", [False, True])
def test_gated_rms_norm_strided_rows_bit_equal(dtype, x_strided):
    """The decode step's output norm: o packed (or strided) with the gate a per-head view of the product."""
    p = _product(dtype, 4)
    gate = _heads(p, 100)
    x = _heads(p, 2) if x_strided else torch.randn(B, 1, H, K, generator=torch.Generator().manual_seed(5)).to(
        dtype).requires_grad_()
    w = torch.randn(K, generator=torch.Generator().manual_seed(6)).requires_grad_()
    y = gated_rms_norm(x, gate, w, 1e-6)
    xc, gc = _packed(x, gate)
    wc = w.detach().clone().requires_grad_()
    yc = gated_rms_norm(xc, gc, wc, 1e-6)
    _eq("y", y, yc)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    y.backward(dy)
    yc.backward(dy)
    _eq("dgate", p.grad[..., 100:100 + H * K].reshape(gc.shape), gc.grad)
    dx = p.grad[..., 2:2 + H * K].reshape(xc.shape) if x_strided else x.grad
    _eq("dx", dx, xc.grad)
    _eq("dw", w.grad, wc.grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_expanded_row_bit_equal(dtype):
    """A stride-0 row dimension (one row read for every batch row)."""
    x = torch.randn(1, 40, generator=torch.Generator().manual_seed(8)).to(dtype).expand(B, 40)
    w = torch.randn(40, generator=torch.Generator().manual_seed(9))
    _eq("y", rms_norm(x, w, 1e-6), rms_norm(x.contiguous(), w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_strided_rows_bit_equal(dtype):
    """The decode step's MLP: gate and up are adjacent column slices of one product."""
    I = 70
    p = _product(dtype, 10)
    gate, up = _slice(p, 0, I), _slice(p, I, I)
    assert rows(gate).strided and rows(up).strided
    gc, uc = _packed(gate, up)
    h = swiglu_forward(gate, up)
    _eq("h", h, swiglu_forward(gc, uc))
    assert h.is_contiguous()
    dh = torch.randn(h.shape, generator=torch.Generator().manual_seed(11)).to(dtype)
    for name, got, want in zip(("dgate", "dup"), swiglu_backward(dh, gate, up), swiglu_backward(dh, gc, uc)):
        _eq(name, got, want)
    # one operand strided, the other packed; and per-head views (two row levels)
    _eq("h mixed", swiglu_forward(gc, up), swiglu_forward(gc, uc))
    g2, u2 = _heads(p, 1), _heads(p, 60)
    _eq("h heads", swiglu_forward(g2, u2), swiglu_forward(*_packed(g2, u2)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_prologue_l2norm_strided_rows_bit_equal(dtype):
    p = _product(dtype, 12)
    x = _heads(p, 9)
    assert rows(x).strided
    xc, = _packed(x)
    y, yc = L2Norm.apply(x, 1e-6), L2Norm.apply(xc, 1e-6)
    _eq("y", y, yc)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(13)).to(dtype)
    y.backward(dy)
    yc.backward(dy)
    _eq("dx", p.grad[..., 9:9 + H * K].reshape(xc.shape), xc.grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neg", [False, True])
def test_prologue_gate_strided_rows_bit_equal(dtype, neg):
    HV = 6
    p = _product(dtype, 14)
    a, b = _slice(p, 150, HV), _slice(p, 150 + HV, HV)
    assert rows(a).strided and rows(b).strided
    ac, bc = _packed(a, b)
    gen = torch.Generator().manual_seed(15)
    A_log, dt_bias = torch.randn(HV, generator=gen) * 0.5, torch.randn(HV, generator=gen) * 0.5
    params = [t.clone().requires_grad_() for t in (A_log, dt_bias)]
    params_c = [t.clone().requires_grad_() for t in (A_log, dt_bias)]
    g, beta = Gate.apply(a, b, *params, neg)
    gc, betac = Gate.apply(ac, bc, *params_c, neg)
    _eq("g", g, gc)
    _eq("beta", beta, betac)
    dg, dbeta = torch.randn(g.shape, generator=gen), torch.randn(g.shape, generator=gen)
    ((g * dg).sum() + (beta * dbeta).sum()).backward()
    ((gc * dg).sum() + (betac * dbeta).sum()).backward()
    _eq("da", p.grad[..., 150:150 + HV], ac.grad)
    _eq("db", p.grad[..., 150 + HV:150 + 2 * HV], bc.grad)
    _eq("dA_log", params[0].grad, params_c[0].grad)
    _eq("ddt_bias", params[1].grad, params_c[1].grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neg", [False, True])
def test_prologue_is_one_node_with_the_three_functions_results(dtype, neg):
    """prologue() with the L2 norms is one autograd node (Prologue) whose outputs and gradients are
    those of Gate and the two L2Norms applied one by one, to the bit; a q that wants no gradient
    gets none (its norm's backward is not run)."""
    HV = 6
    gen = torch.Generator().manual_seed(18)
    A_log, dt_bias = torch.randn(HV, generator=gen) * 0.5, torch.randn(HV, generator=gen) * 0.5
    res = []
    for fused in (True, False):
        p = _product(dtype, 19)
        q, k = _heads(p, 0), _heads(p, H * K)
        a, b = _slice(p, 2 * H * K, HV), _slice(p, 2 * H * K + HV, HV)
        params = [t.clone().requires_grad_() for t in (A_log, dt_bias)]
        if fused:
            outs = prologue(q, k, a, b, *params, True, neg)
            assert {type(o.grad_fn).__name__ for o in outs} == {"PrologueBackward"}
        else:
            outs = (L2Norm.apply(q, 1e-6), L2Norm.apply(k, 1e-6), *Gate.apply(a, b, *params, neg))
        g2 = torch.Generator().manual_seed(20)
        sum((o.float() * torch.randn(o.shape, generator=g2)).sum() for o in outs).backward()
        res.append([o.detach() for o in outs] + [p.grad, *(t.grad for t in params)])
    for name, x, y in zip(("q", "k", "g", "beta", "dproduct", "dA_log", "ddt_bias"), *res):
        _eq(name, x, y)
    q, k = torch.randn(2, 5, H, K, dtype=dtype), torch.randn(2, 5, H, K, dtype=dtype, requires_grad=True)
    a, b = torch.randn(2, 5, HV, dtype=dtype), torch.randn(2, 5, HV, dtype=dtype)
    qn, kn, g, beta = Prologue.apply(q, k, a, b, A_log, dt_bias, 1e-6, neg)
    (qn.float().sum() + kn.float().sum() + g.sum()).backward()
    assert q.grad is None and k.grad is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_prologue_decode_step_views_bit_equal(dtype):
    """The whole prologue of a decode step on views of one product, as the layer hands them over."""
    HV = 6
    with torch.no_grad():
        p = _product(dtype, 16, batch=7).detach()
        q, k = _heads(p, 0), _heads(p, H * K)
        a, b = _slice(p, 2 * H * K, HV), _slice(p, 2 * H * K + HV, HV)
        gen = torch.Generator().manual_seed(17)
        A_log, dt_bias = torch.randn(HV, generator=gen) * 0.5, torch.randn(HV, generator=gen) * 0.5
        got = prologue(q, k, a, b, A_log, dt_bias, True, False)
        want = prologue(*[t.contiguous() for t in (q, k, a, b)], A_log, dt_bias, True, False)
    for name, x, y in zip(("q", "k", "g", "beta"), got, want):
        _eq(name, x, y)
