"""The model's Triton glue kernels on the GPU against their PyTorch forms run in float64: the causal
short convolution (:mod:`gdn.ops.triton.short_conv`), RMSNorm and gated RMSNorm
(:mod:`gdn.ops.triton.rmsnorm`), the SwiGLU product (:mod:`gdn.ops.triton.swiglu`) and the row
passes of the chunked cross entropy (:mod:`gdn.ops.triton.cross_entropy`), at the 340m training
shapes and at awkward ones; then that the layers dispatch to these kernels on CUDA.

Every output and gradient is a relative RMS error against the PyTorch form in float64 on the same
inputs. Bounds: 1e-5 in fp32; in bf16 twice the PyTorch form's own error in bf16 (for the conv
and the norms at least 1e-2: one bf16 rounding is ≈ 2e-3, a wrong kernel O(1)). The kernels
must also return the dtypes the PyTorch forms return.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gdn.layers import GatedRMSNorm, RMSNorm, ShortConvolution
from gdn.ops.conv import ConvActFn, conv_act
from gdn.ops.norm import GatedRMSNormFn, RMSNormFn
from gdn.ops.triton.cross_entropy import logsumexp_pick, softmax_grad
from gdn.ops.triton.rmsnorm import add_rms_norm, gated_rms_norm, rms_norm
from gdn.ops.triton.short_conv import short_conv
from gdn.ops.triton.swiglu import swiglu_backward, swiglu_forward

from .helpers import DEVICE, assert_within, dtype_id, offsets, rel_err

DTYPES = (torch.float32, torch.bfloat16)
FP32_TOL = 1e-5


def grads(fn, inputs, dy):
    """[output, gradients of the inputs that need one] of ``fn(*inputs)`` for cotangent ``dy``;
    ``inputs``: (tensor or None, needs grad) pairs."""
    ins = [None if t is None else t.detach().clone().requires_grad_(need) for t, need in inputs]
    y = fn(*ins)
    wrt = [t for t in ins if t is not None and t.requires_grad]
    return [y.detach(), *torch.autograd.grad(y, wrt, dy.to(y.dtype))]


def compare(names, ours, theirs, ref, dtype, what, floor=0.0):
    """Errors of the kernels' results ``ours`` and the bound (1e-5, or in half precision
    ``max(2 × the PyTorch form's error, floor)``); the dtypes must match the PyTorch form's."""
    errs, bounds = {}, {}
    for name, a, b, r in zip(names, ours, theirs, ref):
        assert a.dtype == b.dtype, f"{what} {name}: kernel returns {a.dtype}, PyTorch {b.dtype}"
        errs[name] = rel_err(a, r)
        bounds[name] = FP32_TOL if dtype == torch.float32 else max(2 * rel_err(b, r), floor)
    assert_within(errs, bounds, f"{what} {dtype_id(dtype)}")


def torch_conv(x, w, h, cu, act):
    if cu is None and h is None:
        h = x.new_zeros(x.shape[0], x.shape[2], w.shape[1] - 1)
    return ConvActFn.apply(x, w, h, cu, act)


#: (B, T, D, activation, with a history, packed lengths or None)
CONV = [
    (4, 4096, 768, "silu", False, None),
    (4, 4096, 1536, "silu", False, None),
    (4, 4096, 768, "silu", True, None),
    (2, 37, 100, None, True, None),
    (1, 8192, 768, "silu", False, (1, 0, 3000, 5, 4096, 1090)),
    (1, 50, 7, None, False, (1, 0, 49)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("B,T,D,act,with_hist,lens", CONV,
                         ids=[f"{c[0]}x{c[1]}x{c[2]}-{c[3]}" + ("-hist" if c[4] else "") + ("-packed" if c[5] else "")
                              for c in CONV])
def test_short_conv(B, T, D, act, with_hist, lens, dtype, device=DEVICE):
    gen = torch.Generator(device=device).manual_seed(T + D)
    x = torch.randn(B, T, D, device=device, generator=gen).to(dtype)
    w = torch.randn(D, 4, device=device, generator=gen) / 2
    h = torch.randn(B, D, 3, device=device, generator=gen).to(dtype) if with_hist else None
    cu = None if lens is None else offsets(lens, device)
    dy = torch.randn(B, T, D, device=device, generator=gen).to(dtype)
    inputs = [(x, True), (w, True), (h, True)]
    ref = grads(lambda a, b, c: torch_conv(a, b, c, cu, act),
                [(None if t is None else t.double(), n) for t, n in inputs], dy.double())
    ours = grads(lambda a, b, c: short_conv(a, b, c, cu, act), inputs, dy)
    theirs = grads(lambda a, b, c: torch_conv(a, b, c, cu, act), inputs, dy)
    compare(["y", "dx", "dw", "dhist"][:len(ref)], ours, theirs, ref, dtype, f"conv {[B, T, D]}", floor=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("lens", [None, (1, 0, 3000, 5, 4096, 1090)], ids=["history", "packed"])
def test_short_conv_reads_a_column_block_in_place(lens, dtype, device=DEVICE):
    """x a column block of a wider product (a mixer's joined projections, rows of 4624 columns: the
    340m layer's, padded to a multiple of 8): the results and gradients of its contiguous copy, bit
    for bit."""
    gen = torch.Generator(device=device).manual_seed(11)
    B, T = (1, 8192) if lens else (4, 4096)
    wide = torch.randn(B, T, 4624, device=device, generator=gen).to(dtype)
    w = torch.randn(1536, 4, device=device, generator=gen) / 2
    h = None if lens else torch.randn(B, 1536, 3, device=device, generator=gen).to(dtype)
    cu = None if lens is None else offsets(lens, device)
    dy = torch.randn(B, T, 1536, device=device, generator=gen).to(dtype)

    def run(block):
        leaves = [t.detach().clone().requires_grad_() for t in (wide, w, h) if t is not None]
        x = block(leaves[0])
        assert x.is_contiguous() == (block is not strided)
        y = short_conv(x, leaves[1], leaves[2] if h is not None else None, cu, "silu")
        return [y.detach(), *torch.autograd.grad(y, leaves, dy)]

    def strided(t):
        return t[..., 1536:3072]

    ours, copy = run(strided), run(lambda t: strided(t).contiguous())
    assert all(torch.equal(a, b) for a, b in zip(ours, copy))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("lens", [None, (1, 0, 3000, 5, 4096, 1090)], ids=["history", "packed"])
def test_short_conv_group_is_the_three_convolutions(lens, dtype, device=DEVICE):
    """q, k and v of the 340m layer (768, 768 and 1536 channels side by side in rows of 4624) through
    one convolution over their channels: the outputs and the product's gradient of the three
    convolutions run one by one, bit for bit; the weights' gradients within fp32 rounding (their
    partial sums may be added in another order)."""
    from gdn.ops.triton.short_conv import short_conv_group

    gen = torch.Generator(device=device).manual_seed(12)
    B, T = (1, 8192) if lens else (4, 4096)
    sizes = (768, 768, 1536)
    wide = torch.randn(B, T, 4624, device=device, generator=gen).to(dtype)
    ws = [torch.randn(n, 4, device=device, generator=gen) / 2 for n in sizes]
    hs = None if lens else [torch.randn(B, n, 3, device=device, generator=gen).to(dtype) for n in sizes]
    cu = None if lens is None else offsets(lens, device)
    dys = [torch.randn(B, T, n, device=device, generator=gen).to(dtype) for n in sizes]

    def run(group):
        y = wide.detach().clone().requires_grad_()
        wl = [w.detach().clone().requires_grad_() for w in ws]
        hl = None if hs is None else [h.detach().clone().requires_grad_() for h in hs]
        xs = (y[..., :768], y[..., 768:1536], y[..., 1536:3072])
        if group:
            outs = short_conv_group(xs, wl, None if hl is None else torch.cat(hl, 1), cu, "silu")
            assert outs is not None
        else:
            outs = [short_conv(x, w, None if hl is None else h, cu, "silu")
                    for x, w, h in zip(xs, wl, hl or [None] * 3)]
        leaves = [y, *wl] + (hl or [])
        return [o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, dys))

    ours, theirs = run(True), run(False)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if 4 <= i < 7:  # dw
            assert rel_err(a, b.double()) < 1e-6, i
        else:
            assert torch.equal(a, b), i


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape,gated", [((4, 4096, 1024), False), ((4 * 4096 * 6, 256), True), ((3, 17, 100), True),
                                         ((5, 7), False)], ids=["rms-4x4096x1024", "gated-98304x256",
                                                                "gated-3x17x100", "rms-5x7"])
def test_rms_norm(shape, gated, dtype, device=DEVICE):
    gen = torch.Generator(device=device).manual_seed(shape[-1])
    x = (2 * torch.randn(shape, device=device, generator=gen)).to(dtype)
    g = (2 * torch.randn(shape, device=device, generator=gen)).to(dtype)
    w = 1 + 0.5 * torch.randn(shape[-1], device=device, generator=gen)
    dy = torch.randn(shape, device=device, generator=gen).to(dtype)
    if gated:
        inputs = [(x, True), (g, True), (w, True)]
        ref = grads(lambda a, b, c: GatedRMSNormFn.apply(a, b, c, 1e-6), [(t.double(), n) for t, n in inputs],
                    dy.double())
        ours = grads(lambda a, b, c: gated_rms_norm(a, b, c, 1e-6), inputs, dy)
        theirs = grads(lambda a, b, c: GatedRMSNormFn.apply(a, b, c, 1e-6), inputs, dy)
        names = ["y", "dx", "dgate", "dw"]
    else:
        inputs = [(x, True), (w, True)]
        ref = grads(lambda a, b: RMSNormFn.apply(a, b, 1e-6, torch.float64), [(t.double(), n) for t, n in inputs],
                    dy.double())
        ours = grads(lambda a, b: rms_norm(a, b, 1e-6), inputs, dy)
        theirs = grads(lambda a, b: RMSNormFn.apply(a, b, 1e-6, dtype), inputs, dy)
        names = ["y", "dx", "dw"]
    compare(names, ours, theirs, ref, dtype, f"{'gated ' if gated else ''}rmsnorm {list(shape)}", floor=1e-2)


@pytest.mark.parametrize("x_dtype,h_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.float32)], ids=["fp32+bf16", "bf16", "fp32"])
@pytest.mark.parametrize("shape", [(4, 4096, 1024), (3, 17, 100)], ids=["4x4096x1024", "3x17x100"])
def test_add_rms_norm(shape, x_dtype, h_dtype, device=DEVICE):
    """The training block's residual add and the norm after it (fp32 stream + bf16 block output,
    normed to bf16 under autocast), one kernel each way, against x + h and the norm in float64:
    s, y and the gradients of x, h and the weight, both outputs read downstream."""
    gen = torch.Generator(device=device).manual_seed(shape[-1])
    x = (2 * torch.randn(shape, device=device, generator=gen)).to(x_dtype)
    h = torch.randn(shape, device=device, generator=gen).to(h_dtype)
    w = 1 + 0.5 * torch.randn(shape[-1], device=device, generator=gen)
    out = h_dtype
    ds = torch.randn(shape, device=device, generator=gen).to(x_dtype)
    dy = torch.randn(shape, device=device, generator=gen).to(out)

    def run(fn, ins):
        s, y = fn(*ins)
        torch.autograd.backward((s, y), (ds.to(s.dtype), dy.to(y.dtype)))
        return [s.detach(), y.detach()] + [t.grad for t in ins]

    def leaves(dt=None):
        return [t.detach().clone().to(dt or t.dtype).requires_grad_() for t in (x, h, w)]

    def two_ops(a, b, c, out_dtype):
        s = a + b
        return s, RMSNormFn.apply(s, c, 1e-6, out_dtype)

    ours = run(lambda a, b, c: add_rms_norm(a, b, c, 1e-6, out), leaves())
    ref = run(lambda a, b, c: two_ops(a, b, c, torch.float64), leaves(torch.float64))
    theirs = run(lambda a, b, c: two_ops(a, b, c, out), leaves())
    compare(["s", "y", "dx", "dh", "dw"], ours, theirs, ref, torch.float32 if out == torch.float32 else torch.bfloat16,
            f"add + rmsnorm {list(shape)}", floor=1e-2)


def test_layers_dispatch_to_the_kernels(device=DEVICE):
    """ShortConvolution, RMSNorm and GatedRMSNorm run the Triton kernels on CUDA (bit-equal
    results), keep PyTorch's dtypes under autocast, and the convolution continues from a state."""
    x = torch.randn(2, 64, 96, device=device)
    conv, norm, gnorm = ShortConvolution(96).to(device), RMSNorm(96).to(device), GatedRMSNorm(96).to(device)
    with torch.no_grad():
        assert torch.equal(conv(x)[0], short_conv(x, conv.weight)), "ShortConvolution does not run the Triton conv"
        assert torch.equal(norm(x), rms_norm(x, norm.weight, norm.eps)), "RMSNorm does not run the Triton norm"
        assert torch.equal(gnorm(x, x.flip(0)), gated_rms_norm(x, x.flip(0), gnorm.weight, gnorm.eps)), \
            "GatedRMSNorm does not run the Triton norm"
        with torch.autocast(device, dtype=torch.bfloat16):
            yc, yn, yg = conv(x)[0], norm(x), gnorm(x, x)
            yc_ref = conv_act(x, conv.weight, x.new_zeros(2, 96, 3), None, "silu")
        assert (yc.dtype, yn.dtype, yg.dtype) == (yc_ref.dtype, torch.bfloat16, torch.float32)
        state = torch.randn(2, 96, 3, device=device)
        y1, s1 = conv(x, state=state, output_state=True)
        y2 = conv_act(x, conv.weight, state, None, "silu")
        assert rel_err(y1, y2) <= FP32_TOL and s1.shape == (2, 96, 3)


def torch_swiglu(g, u, dh):
    h = F.silu(g) * u
    dg = torch.ops.aten.silu_backward(dh * u, g)
    return h, dg, dh * F.silu(g)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_swiglu(dtype, device=DEVICE, shape=(16384, 2816)):
    """The product ``SiLU(g) · u`` and its backward at the 340m MLP's [tokens, hidden] shape."""
    gen = torch.Generator(device=device).manual_seed(0)
    g = (3 * torch.randn(*shape, device=device, generator=gen)).to(dtype)
    u = torch.randn(*shape, device=device, generator=gen).to(dtype)
    dh = torch.randn(*shape, device=device, generator=gen).to(dtype)
    ref = torch_swiglu(g.double(), u.double(), dh.double())
    ours = (swiglu_forward(g, u), *swiglu_backward(dh, g, u))
    compare(("h", "dgate", "dup"), ours, torch_swiglu(g, u, dh), ref, dtype, "swiglu", floor=2e-7)
    # the backward forming the product too (what the down projection's dw reads): the same three, bit for bit
    dg, du, h = swiglu_backward(dh, g, u, want_h=True)
    assert torch.equal(h, ours[0]) and torch.equal(dg, ours[1]) and torch.equal(du, ours[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_swiglu_backward_into_the_joined_gradient(dtype, device=DEVICE, T=4096, I=2816):
    """The training MLP's layout: gate and up the column blocks of one product [T, 2I]; the backward
    writes both gradients into one [T, 2I] tensor, bit for bit the packed pass's, and the SwiGLU
    layer's gradients match the per-projection path's."""
    gen = torch.Generator(device=device).manual_seed(3)
    gu = (2 * torch.randn(T, 2 * I, device=device, generator=gen)).to(dtype)
    g, u = gu.chunk(2, -1)
    dh = torch.randn(T, I, device=device, generator=gen).to(dtype)
    out = torch.full_like(gu, float("nan"))
    swiglu_backward(dh, g, u, out=out.chunk(2, -1))
    assert torch.equal(out, torch.cat(swiglu_backward(dh, g.contiguous(), u.contiguous()), -1))

    from gdn.layers import SwiGLU
    torch.manual_seed(0)
    mlp = SwiGLU(256, 704).to(device)
    x = torch.randn(2, 300, 256, device=device)
    grads = []
    for hooked in (False, True):
        h = mlp.up_proj.register_forward_hook(lambda mod, inp, o: o) if hooked else None
        xr = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            y = mlp(xr)
        y.float().square().sum().backward()
        grads.append([y.detach().float(), xr.grad] + [p.grad.clone() for p in mlp.parameters()])
        mlp.zero_grad()
        if h is not None:
            h.remove()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(*grads):
        assert ((a - b).norm() / b.norm()).item() < tol


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("batch", [1, 32])
def test_strided_rows_bit_equal(batch, dtype, device=DEVICE):
    """The decode step's layouts on the compiled kernels: column slices of one product (and their
    per-head views) give the outputs and gradients of a contiguous copy, bit for bit, for two
    product widths (the row strides are run-time arguments)."""
    from gdn.ops.delta.triton.prologue import Gate, L2Norm
    H, K, HV, I = 4, 128, 8, 2816
    for width in (3 * H * K + 2 * HV + 64, 2 * I + 8):
        gen = torch.Generator(device=device).manual_seed(width)
        p = (2 * torch.randn(batch, 1, width, device=device, generator=gen)).to(dtype)

        def heads(start):
            return p[..., start:start + H * K].view(batch, 1, H, K)

        def both(fn, *views):
            """fn on the views and on contiguous copies, with the gradients of each."""
            outs = []
            for ins in (views, [v.contiguous() for v in views]):
                ins = [v.detach().requires_grad_() for v in ins]
                y = fn(*ins)
                ys = y if isinstance(y, tuple) else (y,)
                dys = [torch.ones_like(t) * 0.5 + t.detach() * 0.25 for t in ys]
                outs.append([t.detach() for t in ys] + list(torch.autograd.grad(ys, ins, dys)))
            for a, b in zip(*outs):
                assert torch.equal(a, b), (fn, width, batch)

        if width == 2 * I + 8:
            g, u = p[..., :I], p[..., I:2 * I]
            dh = torch.randn(batch, 1, I, device=device, generator=gen).to(dtype)
            gc, uc = g.contiguous(), u.contiguous()
            assert torch.equal(swiglu_forward(g, u), swiglu_forward(gc, uc))
            for a, b in zip(swiglu_backward(dh, g, u), swiglu_backward(dh, gc, uc)):
                assert torch.equal(a, b)
            continue
        w = 1 + 0.5 * torch.randn(K, device=device, generator=gen)
        both(lambda x: rms_norm(x, w, 1e-6), heads(0))
        both(lambda x, g: gated_rms_norm(x, g, w, 1e-6), heads(H * K), heads(2 * H * K))
        both(lambda x: L2Norm.apply(x, 1e-6), heads(0))
        A_log, dt = torch.randn(HV, device=device, generator=gen), torch.randn(HV, device=device, generator=gen)
        a, b = p[..., 3 * H * K:3 * H * K + HV], p[..., 3 * H * K + HV:3 * H * K + 2 * HV]
        both(lambda a, b: Gate.apply(a, b, A_log, dt, False), a, b)


def torch_ce(z, t, coef):
    zf = z.float() if z.dtype != torch.float64 else z
    lse = torch.logsumexp(zf, -1)
    picked = zf.gather(1, t[:, None])[:, 0]
    p = torch.exp(zf - lse[:, None])
    p[torch.arange(z.shape[0], device=z.device), t] -= 1.0
    return lse, picked, (p * coef[:, None]).to(z.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_cross_entropy_rows(dtype, device=DEVICE, rows=1048, vocab=32000):
    """Per row the log-sum-exp, the target's logit and ``coef · (softmax − onehot)``: the passes of
    the chunked cross entropy at a 32000-word vocabulary."""
    gen = torch.Generator(device=device).manual_seed(1)
    z = (4 * torch.randn(rows, vocab, device=device, generator=gen)).to(dtype)
    t = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    coef = torch.rand(rows, device=device, generator=gen) / 16384
    ref = torch_ce(z.double(), t, coef.double())
    lse, picked = logsumexp_pick(z, t)
    ours = (lse, picked, softmax_grad(z, lse, t, coef))
    compare(("lse", "picked", "dz"), ours, torch_ce(z, t, coef), ref, dtype, "cross entropy rows", floor=2e-7)


@pytest.mark.parametrize("shape", [(768, 256), (1024, 1024), (256, 12288), (16384, 6), (1 << 20, 6), (5, 3)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_colsum(shape, dtype, device=DEVICE):
    """gdn.ops.triton.colsum at the 340m step's partial sums (the norms', the convolution's, the
    gate's) and a million tokens of the gate (its rows split over programs, then summed again):
    the float64 sum within fp32's accumulation, the same at every call."""
    from gdn.ops.triton.colsum import colsum

    x = torch.randn(shape, device=device, generator=torch.Generator(device=device).manual_seed(7)).to(dtype)
    got = colsum(x)
    assert got.dtype == torch.float32 and got.shape == (shape[1],)
    assert rel_err(got, x.double().sum(0)) <= 1e-6, rel_err(got, x.double().sum(0))
    assert torch.equal(colsum(x), got)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=dtype_id)
def test_accumulate_product_sums_into_fp32(dtype, device=DEVICE):
    """``acc += a @ b`` summed into the fp32 ``acc`` by the product itself (the head's weight
    gradient over chunks of tokens): equal to the float64 sum within fp32's accumulation, the
    earlier contents of ``acc`` kept, three chunks in a row."""
    from gdn.ops.loss import accumulate_product

    gen = torch.Generator(device=device).manual_seed(3)
    acc = torch.randn(320, 96, device=device, generator=gen)
    want = acc.double()
    for rows in (1048, 1048, 17):
        a = torch.randn(320, rows, device=device, generator=gen).to(dtype)
        b = torch.randn(rows, 96, device=device, generator=gen).to(dtype)
        accumulate_product(acc, a, b)
        want += a.double() @ b.double()
    assert acc.dtype == torch.float32
    assert rel_err(acc, want) <= 1e-5, rel_err(acc, want)  # (fp32 sums: ≈ 1e-6; a bf16-rounded product ≈ 2e-3)
    from gdn.ops import loss

    # torch 2.8 and later sum in the product (out_dtype); earlier ones take the fallback
    assert loss._FP32_OUT[0] == (tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 8))


def test_linear_cross_entropy_gradients(device=DEVICE, N=4096, D=256, vocab=32000):
    """The chunked head and loss under bf16 autocast (4 chunks of tokens): loss, dh and dW against
    the float64 loss of the same bf16 h and W, within twice the error of PyTorch's own bf16 form."""
    from gdn.ops.loss import linear_cross_entropy

    gen = torch.Generator(device=device).manual_seed(4)
    h0 = torch.randn(N, D, device=device, generator=gen).to(torch.bfloat16)
    w0 = (torch.randn(vocab, D, device=device, generator=gen) / D ** 0.5)
    t = torch.randint(0, vocab, (N,), device=device, generator=gen)
    t[::97] = -100

    def run(fn, cast):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        return [x.double() for x in (loss.detach(), h.grad, w.grad)] if cast else [loss.detach(), h.grad, w.grad]

    def ref(h, w):
        return F.cross_entropy(h.double() @ w.to(torch.bfloat16).double().t(), t)

    def plain(h, w):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return F.cross_entropy(F.linear(h, w).float(), t)

    def ours(h, w):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return linear_cross_entropy(h, w, t)

    want, base, got = run(ref, False), run(plain, True), run(ours, True)
    for name, g, b, r in zip(("loss", "dh", "dW"), got, base, want):
        assert rel_err(g, r) <= max(2 * rel_err(b, r), 1e-4), (name, rel_err(g, r), rel_err(b, r))


def test_mixer_joined_gradient_written_in_place(monkeypatch, device=DEVICE):
    """A Gated DeltaNet layer at training shapes under bf16 autocast: the short convolutions' dx and
    the gated norm's dgate land in the joined projection's gradient in place (their kernels at the
    product's strides), and every gradient matches the layers called one by one."""
    from gdn.layers import GatedDeltaNet
    from tests.joined_spy import record_placed

    placed = record_placed(monkeypatch)  # per backward of a split: blocks written in place
    torch.manual_seed(0)
    m = GatedDeltaNet(512, 4, 128, expand_v=2).to(device).train()
    x = torch.randn(2, 300, 512, device=device)
    dy = torch.randn(2, 300, 512, device=device)
    res = []
    for joined in (True, False):
        monkeypatch.setattr("gdn.layers.recurrent.joinable", (lambda mods: True) if joined else (lambda mods: False))
        m.zero_grad()
        xt = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            o, _ = m(xt)
        o.float().backward(dy)
        res.append([o.detach().float(), xt.grad] + [p.grad.clone() for p in m.parameters()])
    assert placed == [[True, True, True, True, False, False, False]], placed  # blocks q, k, v, g, a, b, padding
    for a, b in zip(*res):
        assert ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item() < 2e-2
