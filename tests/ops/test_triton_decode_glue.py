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


# ---- the residual add inside the RMSNorm after it ------------------------------------------------

from gdn.ops import norm as norm_ops  # noqa: E402
from gdn.ops.triton import rmsnorm as norm_kernels  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_add_rms_norm_kernel(dtype, batch, out_dtype):
    """One launch gives the residual stream x + h (bit-equal to PyTorch's add; in bf16 within one
    ulp, as the interpreter's fp32 -> bf16 cast breaks ties otherwise than round-to-nearest-even)
    and the norm of it (bit-equal to the RMSNorm kernel on that s: the same arithmetic on the same
    rounded values), within rounding of the PyTorch RMSNorm."""
    gen = torch.Generator().manual_seed(batch)
    D = 96
    x = (3 * torch.randn(batch, 1, D, generator=gen)).to(dtype)
    h = torch.randn(batch, 1, D, generator=gen).to(dtype)
    w = 1 + 0.5 * torch.randn(D, generator=gen)
    s, y = norm_kernels.add_rms_norm(x, h, w, 1e-6, out_dtype)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(s, x + h, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(s, x + h)
    assert torch.equal(y, norm_kernels.rms_norm(s, w, 1e-6, out_dtype))
    ref = norm_ops.rms_norm(s, w, 1e-6, out_dtype or dtype)  # CPU tensors: the PyTorch Function
    tol = 1e-6 if (out_dtype or dtype) == torch.float32 else 1e-2
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)


def test_add_forward_routes_to_kernel(monkeypatch):
    """RMSNorm.add_forward takes the kernel where use_triton says so, with or without gradients
    (the training block's x + h, then mlp_norm), and x + h then the norm otherwise; the two agree,
    gradients included."""
    from gdn.layers import RMSNorm
    norm = RMSNorm(32)
    x, h = torch.randn(3, 1, 32), torch.randn(3, 1, 32)
    with torch.no_grad():
        s0, y0 = norm.add_forward(x, h)
    calls = []
    real = norm_kernels.add_rms_norm
    monkeypatch.setattr(norm_kernels, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(norm_ops, "use_triton", lambda x: True)
    with torch.no_grad():
        s1, y1 = norm.add_forward(x, h)
    assert calls == [1] and torch.equal(s0, s1)
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    hk = h.clone().requires_grad_()
    s2, y2 = norm.add_forward(x, hk)  # a gradient is wanted: the kernels' autograd Function
    assert calls == [1, 1] and y2.requires_grad and s2.requires_grad
    (s2.sum() + (y2 * y2).sum()).backward()
    monkeypatch.setattr(norm_ops, "use_triton", lambda x: False)
    hp = h.clone().requires_grad_()
    s3, y3 = norm.add_forward(x, hp)  # the two ops
    assert calls == [1, 1]
    (s3.sum() + (y3 * y3).sum()).backward()
    torch.testing.assert_close(hk.grad, hp.grad, rtol=1e-5, atol=1e-5)


# ---- the whole static step on the kernels' path ---------------------------------------------------

def _kernels_everywhere(monkeypatch):
    """Send every glue op and the router to their Triton kernels for CPU tensors (the interpreter
    runs them), as they go for CUDA tensors."""
    import sys

    from gdn.ops import router
    original = router.use_triton
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("gdn.") and getattr(mod, "use_triton", None) is original:
            monkeypatch.setattr(mod, "use_triton", lambda x: True)


@pytest.mark.parametrize("batch", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_static_step_on_kernels_keeps_greedy_tokens(monkeypatch, batch):
    """fp32 gdn model: the static decode step on the kernels' path (fused conv step, residual adds
    inside the norms, ...) gives the PyTorch path's logits to 1e-4 and the same greedy tokens over
    two steps (the second from the state the first left)."""
    from gdn.generation import prefill
    from gdn.models import GDNConfig, GDNForCausalLM, StaticCache, static_decode_step
    torch.manual_seed(0)
    model = GDNForCausalLM(GDNConfig.from_preset("gdn", "tiny")).eval()
    ids = torch.randint(1, model.config.vocab_size, (batch, 6))
    with torch.no_grad():
        _, gcache = prefill(model, ids)
        caches = []
        for _ in range(2):
            c = StaticCache(model, batch, 32)
            c.load(gcache)
            caches.append(c)
        tok_ref = tok = ids[:, -1].contiguous()
        ref_logits = []
        for _ in range(2):
            lg = static_decode_step(model, caches[0], tok_ref)
            ref_logits.append(lg)
            tok_ref = lg.argmax(-1)
        _kernels_everywhere(monkeypatch)
        for want in ref_logits:
            lg = static_decode_step(model, caches[1], tok)
            torch.testing.assert_close(lg, want, rtol=1e-4, atol=1e-4)
            assert torch.equal(lg.argmax(-1), want.argmax(-1))
            tok = lg.argmax(-1)


# ---- the Gated DeltaNet prologue inside the recurrent step ------------------------------------------

from gdn.ops.delta.triton.pool import fused_gated_delta_rule_step_, fused_recurrent_step_  # noqa: E402
from gdn.ops.delta.triton.prologue import prologue  # noqa: E402


def _gdn_inputs(dtype, batch, H=2, HV=4, K=16, V=32, seed=0):
    """Column slices of one joined product [batch, 1, ·] as the decode step has them (q, k, v heads
    after the conv; a, b raw), A_log, dt_bias [HV] and an fp32 state."""
    gen = torch.Generator().manual_seed(seed)
    widths = [H * K, H * K, HV * V, HV, HV]
    p = torch.randn(batch, 1, sum(widths) + 5, generator=gen).to(dtype)
    q, k, v, a, b = p[..., :sum(widths)].split(widths, -1)
    q, k, v = q.view(batch, 1, H, K), k.view(batch, 1, H, K), v.view(batch, 1, HV, V)
    a = a * 8  # softplus on both sides of its threshold
    A_log, dt_bias = torch.randn(HV, generator=gen), torch.randn(HV, generator=gen)
    state = torch.randn(batch, HV, K, V, generator=gen)
    return q, k, v, a, b, A_log, dt_bias, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("neg", [False, True])
def test_fused_gdn_step_equals_prologue_then_step(dtype, batch, l2, neg):
    """One launch from the raw inputs (strided views) against the prologue kernels then the in-place
    step: without the L2 norms bit-equal (the same gate and β arithmetic); with them within the
    rounding of q̂, k̂ that the separate path makes (fp32: 1e-6; fp16: one fp16 rounding)."""
    q, k, v, a, b, A_log, dt_bias, state = _gdn_inputs(dtype, batch, seed=batch)
    s_ref, s_got = state.clone(), state.clone()
    qn, kn, g, beta = prologue(q, k, a, b, A_log, dt_bias, l2, neg)
    want = fused_recurrent_step_(qn, kn, v, g, beta, s_ref)
    got = fused_gated_delta_rule_step_(q, k, v, a, b, A_log, dt_bias, s_got, use_qk_l2norm=l2, allow_neg_eigval=neg)
    if not l2:
        assert torch.equal(got, want) and torch.equal(s_got, s_ref)
    else:
        tol = 1e-6 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(s_got, s_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_fused_gdn_step_in_the_op(monkeypatch):
    """gdn.ops.gated_delta_rule_fused_step_ on the token-recurrent kernel runs one launch (the fused
    step) and matches the chunk form's step to 1e-5 in fp32."""
    from gdn import ops
    from gdn.ops.delta.triton import pool
    q, k, v, a, b, A_log, dt_bias, state = _gdn_inputs(torch.float32, 3, seed=9)
    s_ref, s_got = state.clone(), state.clone()
    want = ops.gated_delta_rule_fused_step_(q, k, v, a, b, A_log, dt_bias, s_ref, backend="chunk")
    calls = []
    real = pool.fused_gated_delta_rule_step_
    from gdn.ops.delta import step
    monkeypatch.setattr(step, "fused_gated_delta_rule_step_", lambda *x, **kw: calls.append(1) or real(*x, **kw))
    _kernels_everywhere(monkeypatch)
    got = ops.gated_delta_rule_fused_step_(q, k, v, a, b, A_log, dt_bias, s_got)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_got, s_ref, rtol=1e-5, atol=1e-5)
