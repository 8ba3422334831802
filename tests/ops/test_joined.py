"""Column blocks whose gradients their consumers write into one buffer (gdn.ops.joined)."""
from __future__ import annotations

import pytest
import torch

from gdn.ops.joined import grad_slot, split_columns, view_block


class _Twice(torch.autograd.Function):
    """2·x, writing its input gradient into x's slot of a joined gradient when x has one."""

    @staticmethod
    def forward(ctx, x):
        ctx.slot = grad_slot(x)
        return 2 * x

    @staticmethod
    def backward(ctx, dy):
        target = ctx.slot.take() if ctx.slot is not None else None
        if target is None:
            return 2 * dy
        return torch.mul(dy, 2, out=target)


def _grads(fn, y):
    y = y.detach().requires_grad_()
    fn(y).backward()
    return y.grad


def test_blocks_and_gradients_are_those_of_split():
    y = torch.randn(2, 3, 10, dtype=torch.float64)
    sizes = [3, 4, 2, 1]
    parts = split_columns(y.requires_grad_(), sizes)
    assert all(torch.equal(a, b) for a, b in zip(parts, y.split(sizes, -1)))

    def use(split):
        def fn(t):
            a, b, c, _ = split(t)  # the last block unused: its gradient is zero
            bv = view_block(b, 2, 3, 2, 2) if split is split_columns else b.view(2, 3, 2, 2)
            return (_Twice.apply(a).sin().sum() + (_Twice.apply(bv) * bv).sum()  # b used twice
                    + _Twice.apply(c).cos().sum())
        return fn

    got = _grads(use(lambda t: split_columns(t, sizes)), y)
    want = _grads(use(lambda t: t.split(sizes, -1)), y)
    assert torch.allclose(got, want, rtol=1e-14, atol=1e-14)
    assert torch.equal(got[..., -1], torch.zeros_like(got[..., -1]))


def test_consumers_write_in_place_once_per_block_and_per_backward():
    y = torch.randn(4, 6, requires_grad=True)
    a, b = split_columns(y, [2, 4])
    slot_a, slot_b = grad_slot(a), grad_slot(b)
    assert grad_slot(y) is None and grad_slot(a * 1) is None
    ta = slot_a.take()
    assert ta.shape == a.shape and ta.stride() == a.stride()
    assert slot_a.take() is None  # handed out once
    tb = slot_b.take()
    assert tb.data_ptr() == ta.data_ptr() + 2 * ta.element_size()  # one buffer, the blocks' places in it


def test_retained_graph_gives_the_same_gradient_twice():
    y = torch.randn(3, 5, requires_grad=True)
    a, b = split_columns(y, [2, 3])
    out = _Twice.apply(a).square().sum() + _Twice.apply(b).sum()
    (g1,) = torch.autograd.grad(out, y, retain_graph=True)
    (g2,) = torch.autograd.grad(out, y)
    assert torch.equal(g1, g2)
    assert torch.allclose(g1, torch.cat([8 * y[:, :2], torch.full((3, 3), 2.0)], -1).detach())


def test_plain_split_without_gradients():
    y = torch.randn(3, 5)
    parts = split_columns(y, [2, 3])
    assert grad_slot(parts[0]) is None
    with torch.no_grad():
        assert grad_slot(split_columns(y.requires_grad_(), [2, 3])[0]) is None


@pytest.mark.parametrize("pad", [0, 3])
def test_joined_weight_casts_in_the_join(pad):
    """gdn.layers.fused.joined_weight under autocast: the product's weight already in the autocast
    dtype (one pass instead of a join then a cast), the same bits as ``torch.cat`` then autocast's
    cast, zero pad rows, and each weight's gradient the same as through the join and the cast."""
    import torch.nn.functional as F

    from gdn.layers.fused import joined_weight

    gen = torch.Generator().manual_seed(6)
    ws = [torch.randn(r, 16, generator=gen).requires_grad_() for r in (5, 8, 3)]
    x = torch.randn(7, 16, generator=gen)
    dy = torch.randn(7, 16 + pad, generator=gen)

    def run(join):
        for w in ws:
            w.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = F.linear(x, join())
        y.float().backward(dy)
        return y.detach(), [w.grad.clone() for w in ws]

    got, dgot = run(lambda: joined_weight(ws, torch.bfloat16, pad))
    want, dwant = run(lambda: torch.cat(ws + ([ws[0].new_zeros(pad, 16)] if pad else [])))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    for a, b in zip(dgot, dwant):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    w = joined_weight(ws, torch.bfloat16, pad)
    assert w.dtype == torch.bfloat16 and w.shape == (16 + pad, 16) and not w[16:].any()
    assert joined_weight(ws).dtype == torch.float32  # autocast off: the plain join
