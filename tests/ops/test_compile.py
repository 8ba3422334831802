"""torch.compile of the ops and of the model (gdn.ops.library).

- Every custom op passes ``torch.library.opcheck`` (schema, autograd registration, fake tensor
  against the real output, AOT dispatch) on its PyTorch implementation, in fp64.
- The registered backwards give the eager gradients: ``gradcheck`` in fp64, and compiled against
  eager (``fullgraph=True``: a graph break raises) for each public op.
- The Triton implementations go through the same custom ops: on the CPU under Triton's
  interpreter with the router told that Triton runs (``use_triton``), on CUDA as they are.
- A tiny model compiles whole with ``fullgraph=True`` (forward and a training step), with
  the same logits and gradients as in eager mode; on the CPU with the kernels forced too (slow).
- Eager calls never touch the dispatcher.

``backend="aot_eager"`` is the cheapest backend that traces the backward too: it proves the
graphs have no break without Inductor's compile time.
"""
from __future__ import annotations

import pytest
import torch

import gdn.ops as ops
from gdn.ops import attention, conv, library, loss, norm, router, swiglu
from gdn.ops.delta import fused
from gdn.ops.tuning import INTERPRET

from .helpers import HAS_BETA, HAS_G, MEMBERS, make_inputs, rel_err

RECURRENT = MEMBERS + ("kimi_delta_attention",)
BACKEND = "aot_eager"
F64 = torch.float64


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _recurrent_inputs(op, *, B=2, T=11, H=2, HV=4, K=8, V=4, dtype=F64, state=True, N=None, seed=0,
                      device="cpu", requires_grad=True):
    """(q, k, v, g, beta, initial_state) for ``op``; g and beta None where the member lacks them."""
    d = make_inputs(B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, state=state, N=N, seed=seed)
    if op == "kimi_delta_attention":
        gen = torch.Generator().manual_seed(seed + 1)
        d["g"] = -torch.rand(B, T, HV, K, generator=gen, dtype=F64).to(dtype) * 0.5
    g = d["g"] if op == "kimi_delta_attention" or HAS_G[op] else None
    beta = d["beta"] if op == "kimi_delta_attention" or HAS_BETA[op] else None
    xs = (d["q"], d["k"], d["v"], g, beta, d["initial_state"])
    return tuple(None if x is None else x.to(device).requires_grad_(requires_grad) for x in xs)


def _fused_inputs(*, B=2, T=11, H=2, HV=4, K=8, V=4, dtype=F64, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=F64).to(dtype).to(device).requires_grad_(True)

    return (r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), r(B, T, HV), r(B, T, HV), r(HV), r(HV), r(B, HV, K, V))


def _public(op, q, k, v, g, beta, h0, **kw):
    args = [q, k, v] + ([g] if g is not None else []) + ([beta] if beta is not None else [])
    return getattr(ops, op)(*args, initial_state=h0, **kw)


def _grads(outs, ins, seed=1):
    """Gradients of a random projection of ``outs`` w.r.t. the tensors among ``ins``."""
    gen = torch.Generator().manual_seed(seed)
    outs = [o for o in outs if o is not None]
    cot = [torch.randn(o.shape, generator=gen, dtype=F64).to(o) for o in outs]
    ins = [x for x in ins if x is not None and x.requires_grad]
    return torch.autograd.grad(outs, ins, cot)


def _assert_close(got, want, tol):
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_err(a, b) <= tol, rel_err(a, b)


# ---- opcheck: schema, autograd registration, fake tensors, AOT dispatch --------------------------

def _opcheck(op, args):
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("op", RECURRENT)
@pytest.mark.parametrize("state", [True, False])
def test_opcheck_recurrent(op, state):
    q, k, v, g, beta, h0 = _recurrent_inputs(op, state=state)
    _opcheck(library.RECURRENT_OPS[op], ("chunk", q, k, v, g, beta, None, h0, state, None, None))


def test_opcheck_recurrent_packed_and_naive():
    cu = torch.tensor([0, 4, 4, 5, 11])
    q, k, v, g, beta, h0 = _recurrent_inputs("gated_delta_rule", B=1, N=4)
    for impl in ("chunk", "naive"):
        _opcheck(library.PACKED_RECURRENT_OPS["gated_delta_rule"], (impl, q, k, v, g, beta, 0.3, h0, True, cu, None))


def _ops_in_graph(fn, *args):
    """The ``gdn`` custom ops in the graph dynamo traces of ``fn(*args)`` (forward only)."""
    seen = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "gdn" in str(n.target))
        return gm.forward

    torch.compile(fn, fullgraph=True, backend=record)(*args)
    return seen


def test_packed_calls_are_kept_out_of_cuda_graphs():
    """Packed calls read their offsets on the host, which a CUDA graph cannot capture: they trace
    to ops of their own tagged ``cudagraph_unsafe`` (Inductor's reduce-overhead mode runs those
    outside its graphs, forward and backward), while dense calls trace to untagged ops."""
    unsafe = torch.Tag.cudagraph_unsafe
    packed = [op._opoverload for op in library.PACKED_RECURRENT_OPS.values()]
    packed += [fused._fused_packed_op._opoverload, attention.packed_op._opoverload]
    dense = [op._opoverload for op in library.RECURRENT_OPS.values()] + [fused._fused_op._opoverload]
    for op in packed:
        backward = getattr(torch.ops.gdn, op.name().split("::")[1] + "_backward").default
        assert unsafe in op.tags and unsafe in backward.tags, op
    for op in dense:
        assert unsafe not in op.tags, op
    cu = torch.tensor([0, 30, 30, 31, 70])
    q, k, v, g, beta, h0 = _recurrent_inputs("gated_delta_rule", B=1, T=70, N=4, dtype=torch.float32)
    run = lambda cu_seqlens: lambda *x: ops.gated_delta_rule(*x, cu_seqlens=cu_seqlens)[0]  # noqa: E731
    assert _ops_in_graph(run(cu), q, k, v, g, beta) == ["gdn.gated_delta_rule_packed.default"]
    torch._dynamo.reset()
    assert _ops_in_graph(run(None), q, k, v, g, beta) == ["gdn.gated_delta_rule.default"]
    torch._dynamo.reset()
    x = _fused_inputs(B=1, T=70, dtype=torch.float32)[:7]
    got = _ops_in_graph(lambda *a: ops.gated_delta_rule_fused(*a, cu_seqlens=cu)[0], *x)
    assert got == ["gdn.gated_delta_rule_fused_packed.default"], got


def test_opcheck_fused():
    q, k, v, a, b, A_log, dt_bias, h0 = _fused_inputs()
    _opcheck(fused._fused_op, ("chunk", q, k, v, a, b, A_log, dt_bias, None, h0, True, None, True, True, None))


@pytest.mark.parametrize("gated", [False, True])
def test_opcheck_norm(gated):
    x, gate = torch.randn(2, 3, 8, dtype=F64, requires_grad=True), torch.randn(2, 3, 8, dtype=F64, requires_grad=True)
    w = torch.randn(8, dtype=F64, requires_grad=True)
    _opcheck(norm._norm_op, (x, gate if gated else None, w, 1e-6, F64))


@pytest.mark.parametrize("case", ["hist", "zeros", "packed", "one_token"])
def test_opcheck_short_conv(case):
    T = 1 if case == "one_token" else 9
    x = torch.randn(1 if case == "packed" else 2, T, 6, dtype=F64, requires_grad=True)
    w = torch.randn(6, 4, dtype=F64, requires_grad=True)
    hist = torch.randn(2, 6, 3, dtype=F64, requires_grad=True) if case in ("hist", "one_token") else None
    cu = torch.tensor([0, 3, 3, 9]) if case == "packed" else None
    _opcheck(conv._conv_op, (x, w, hist, cu, case != "zeros", None))


def test_opcheck_swiglu_and_loss():
    gate, up = (torch.randn(2, 5, 12, dtype=F64, requires_grad=True) for _ in range(2))
    _opcheck(swiglu._swiglu_op, (gate, up, torch.randn(7, 12, dtype=F64, requires_grad=True), F64))
    h, w = torch.randn(13, 6, dtype=F64, requires_grad=True), torch.randn(11, 6, dtype=F64, requires_grad=True)
    target = torch.randint(0, 11, (13,))
    target[3] = -100
    _opcheck(loss._lce_op, (h, w, target, -100, F64, True, True))


def test_fake_dtypes_follow_the_implementation():
    """The kernels return an fp32 state whatever the input dtype; the PyTorch forms the compute dtype."""
    q, k, v, g, beta, h0 = _recurrent_inputs("gated_delta_rule", requires_grad=False)
    for impl, want in (("chunk", F64), ("naive", F64), ("triton-chunk", torch.float32)):
        o, S = library.recurrent_fake(impl, q, k, v, g, beta, None, h0, True, None, None)
        assert o.dtype == v.dtype and o.shape == v.shape and S.dtype == want and S.shape == h0.shape


# ---- the registered backwards: gradcheck, compiled against eager --------------------------------

def test_gradcheck_recurrent_and_fused():
    q, k, v, g, beta, h0 = _recurrent_inputs("gated_delta_rule", B=1, T=5, H=1, HV=2, K=3, V=2)
    op = library.RECURRENT_OPS["gated_delta_rule"]
    assert torch.autograd.gradcheck(lambda *x: op("chunk", *x[:5], None, x[5], True, None, None),
                                    (q, k, v, g, beta, h0))
    q, k, v, a, b, A_log, dt_bias, h0 = _fused_inputs(B=1, T=5, H=1, HV=2, K=3, V=2)
    assert torch.autograd.gradcheck(
        lambda *x: fused._fused_op("chunk", *x[:7], None, x[7], True, None, True, False, None),
        (q, k, v, a, b, A_log, dt_bias, h0))


def _compiled_equals_eager(fn, ins, tol):
    want = fn(*ins)
    got = torch.compile(fn, fullgraph=True, backend=BACKEND)(*ins)
    _assert_close([x for x in got if x is not None], [x for x in want if x is not None], tol)
    _assert_close(_grads(got, ins), _grads(want, ins), tol)


@pytest.mark.parametrize("op", RECURRENT)
def test_compiled_recurrent_equals_eager(op):
    ins = _recurrent_inputs(op, dtype=torch.float32, T=70)
    _compiled_equals_eager(lambda *x: _public(op, *x, output_final_state=True), ins, 1e-6)


def test_compiled_recurrent_packed_equals_eager():
    """Packed sequences compile whole too (the values of cu_seqlens are checked in eager calls only)."""
    cu = torch.tensor([0, 30, 30, 31, 70])
    ins = _recurrent_inputs("gated_delta_rule", B=1, T=70, N=4, dtype=torch.float32)
    fn = lambda *x: _public("gated_delta_rule", *x, output_final_state=True, cu_seqlens=cu)  # noqa: E731
    want = fn(*ins)
    got = torch.compile(fn, fullgraph=True, backend=BACKEND)(*ins)
    _assert_close(got, want, 1e-6)
    _assert_close(_grads(got, ins), _grads(want, ins), 1e-6)


def test_compiled_fused_equals_eager():
    ins = _fused_inputs(dtype=torch.float32, T=70)
    _compiled_equals_eager(lambda *x: ops.gated_delta_rule_fused(*x[:7], initial_state=x[7], output_final_state=True,
                                                                 allow_neg_eigval=True), ins, 1e-6)


def test_compiled_glue_equals_eager():
    x, gate = torch.randn(2, 9, 4, 8, requires_grad=True), torch.randn(2, 9, 4, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    cw, hist = torch.randn(32, 4, requires_grad=True), torch.randn(2, 32, 3, requires_grad=True)
    sw = torch.randn(12, 16, requires_grad=True)
    head = torch.randn(50, 8, requires_grad=True)
    target = torch.randint(0, 50, (72,))
    target[::5] = -100

    def glue(x, gate, w, cw, hist, sw, head):
        y = norm.gated_rms_norm(x, gate, w, 1e-6) + norm.rms_norm(x, w, 1e-6, x.dtype)
        c = conv.short_conv(y.reshape(2, 9, 32), cw, hist, None, "silu")
        c = c + conv.short_conv(y.reshape(2, 9, 32), cw, None, None, None)
        s = swiglu.swiglu_down(c[..., :16], c[..., 16:], sw, c.dtype)
        return s, loss.linear_cross_entropy(y.reshape(72, 8), head, target)

    _compiled_equals_eager(glue, (x, gate, w, cw, hist, sw, head), 1e-6)


def test_compiled_softmax_attention_is_traced():
    """SDPA needs no custom op: dynamo traces it, sliding window included."""
    q, k, v = (torch.randn(1, 40, h, 8, requires_grad=True) for h in (4, 2, 2))
    for window in (None, 16):
        _compiled_equals_eager(lambda *x: (ops.softmax_attention(*x, window_size=window),), (q, k, v), 1e-6)


# ---- the Triton implementations through the custom ops ------------------------------------------

@pytest.fixture
def triton_device(monkeypatch):
    """The device the kernels run on: CUDA, or the CPU under Triton's interpreter with every
    op told that Triton runs there."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() and not INTERPRET:
        return "cuda"
    if not INTERPRET:
        pytest.skip("triton was imported without TRITON_INTERPRET and there is no GPU")
    for module in (router, norm, conv, swiglu, loss):
        monkeypatch.setattr(module, "use_triton", lambda x: True)
    return "cpu"


@pytest.mark.parametrize("op", ["gated_delta_rule", "kimi_delta_attention"])
def test_triton_chunk_through_the_op(op, triton_device):
    """The op (forward, recomputing backward) on the Triton chunk kernels equals their eager call."""
    ins = _recurrent_inputs(op, B=1, T=20, H=1, HV=2, K=16, V=16, dtype=torch.float32, device=triton_device)
    fn = lambda *x: _public(op, *x, output_final_state=True)  # noqa: E731
    assert router.route(op, None, *ins[:3], decode_step=False, grad=True, kda=op.startswith("kimi")) == "triton-chunk"
    _compiled_equals_eager(fn, ins, 1e-5)


def test_triton_recurrent_and_fused_through_the_op(triton_device):
    q, k, v, g, beta, h0 = _recurrent_inputs("gated_delta_rule", B=1, T=20, H=1, HV=2, K=16, V=16,
                                             dtype=torch.float32, device=triton_device, requires_grad=False)
    fn = lambda *x: ops.gated_delta_rule(*x[:5], initial_state=x[5], output_final_state=True)  # noqa: E731
    with torch.no_grad():  # a short call without gradients: the token-recurrent kernel
        want, got = fn(q, k, v, g, beta, h0), torch.compile(fn, fullgraph=True, backend=BACKEND)(q, k, v, g, beta, h0)
    _assert_close(got, want, 1e-5)
    ins = _fused_inputs(B=1, T=20, H=1, HV=2, K=16, V=16, dtype=torch.float32, device=triton_device)
    _compiled_equals_eager(lambda *x: ops.gated_delta_rule_fused(*x[:7], initial_state=x[7], output_final_state=True),
                           ins, 1e-5)


def test_triton_glue_through_the_ops(triton_device):
    dev = triton_device
    x, gate = (torch.randn(2, 9, 2, 16, device=dev, requires_grad=True) for _ in range(2))
    w, cw = torch.randn(16, device=dev, requires_grad=True), torch.randn(32, 4, device=dev, requires_grad=True)
    sw, head = torch.randn(12, 16, device=dev, requires_grad=True), torch.randn(40, 16, device=dev, requires_grad=True)
    target = torch.randint(0, 40, (36,), device=dev)

    def glue(x, gate, w, cw, sw, head):
        y = norm.gated_rms_norm(x, gate, w, 1e-6) + norm.rms_norm(x, w, 1e-6, x.dtype)
        c = conv.short_conv(y.reshape(2, 9, 32), cw, None, None, "silu")
        s = swiglu.swiglu_down(c[..., :16], c[..., 16:], sw, c.dtype)
        return s, loss.linear_cross_entropy(y.reshape(36, 16), head, target)

    _compiled_equals_eager(glue, (x, gate, w, cw, sw, head), 1e-5)


# ---- eager calls stay off the dispatcher ---------------------------------------------------------

def test_eager_calls_do_not_use_the_custom_ops(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a custom op ran in eager mode")

    monkeypatch.setattr(library, "RECURRENT_OPS", {name: boom for name in library.RECURRENT_OPS})
    monkeypatch.setattr(library, "PACKED_RECURRENT_OPS", {name: boom for name in library.PACKED_RECURRENT_OPS})
    for module, name in ((fused, "_fused_op"), (fused, "_fused_packed_op"), (norm, "_norm_op"), (conv, "_conv_op"),
                         (swiglu, "_swiglu_op"), (loss, "_lce_op")):
        monkeypatch.setattr(module, name, boom)
    q, k, v, g, beta, h0 = _recurrent_inputs("gated_delta_rule", dtype=torch.float32)
    ops.gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    p = _recurrent_inputs("gated_delta_rule", B=1, T=70, N=2, dtype=torch.float32)
    ops.gated_delta_rule(*p[:5], initial_state=p[5], cu_seqlens=torch.tensor([0, 30, 70]))
    ops.gated_delta_rule_fused(*_fused_inputs(dtype=torch.float32)[:7])
    x = torch.randn(2, 3, 8, requires_grad=True)
    norm.rms_norm(x, torch.ones(8), 1e-6, x.dtype)
    norm.gated_rms_norm(x, x, torch.ones(8), 1e-6)
    conv.short_conv(x, torch.randn(8, 4), None, None, "silu")
    swiglu.swiglu_down(x, x, torch.randn(5, 8), x.dtype)
    loss.linear_cross_entropy(x.reshape(6, 8), torch.randn(5, 8), torch.zeros(6, dtype=torch.long))


# ---- the model ----------------------------------------------------------------------------------

def _model(preset, pattern=None):
    from gdn.models import GDNConfig, GDNForCausalLM

    kw = dict(hidden_size=32, num_hidden_layers=2, head_dim=16, intermediate_size=64)
    if pattern:
        kw.update(layer_pattern=pattern, num_hidden_layers=len(pattern))
    torch.manual_seed(0)
    return GDNForCausalLM(GDNConfig.from_preset(preset, "tiny", **kw))


def _check_model(model, T=70, tol=1e-10):
    ids = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    model.eval()
    with torch.no_grad():
        logits = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
        assert rel_err(torch.compile(logits, fullgraph=True, backend=BACKEND)(ids), logits(ids)) <= tol
    model.train()
    _check_training_step(model, ids, tol)


def _check_training_step(model, ids, tol, **kw):
    """A compiled (fullgraph) training step gives the eager step's loss and gradients."""
    step = lambda ids: model(input_ids=ids, labels=ids, **kw).loss  # noqa: E731
    want = step(ids)
    want.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = torch.compile(step, fullgraph=True, backend=BACKEND)(ids)
    got.backward()
    assert rel_err(got, want) <= tol
    for n, p in model.named_parameters():
        assert rel_err(p.grad, grads[n]) <= tol, n


@pytest.mark.parametrize("preset, pattern", [  # attention's compile: test_packed_training_step_compiles_whole
    ("gdn", None), pytest.param("gdn-h1", None, marks=pytest.mark.slow), ("gdn", "KMDL")], ids=["gdn", "gdn-h1", "KMDL"])
def test_model_compiles_whole(preset, pattern):
    _check_model(_model(preset, pattern).double(), tol=1e-10)


@pytest.mark.parametrize("pattern", ["GS", "KMDLA"])
def test_packed_training_step_compiles_whole(pattern):
    """The step `gdn train` runs: one packed row with cu_seqlens (sequences of 20, 1, 0 and 49 tokens)."""
    model = _model("gdn", pattern).double().train()
    ids = torch.randint(0, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 20, 21, 21, 70], dtype=torch.int32)
    _check_training_step(model, ids, 1e-10, cu_seqlens=cu)


@pytest.mark.slow
def test_model_compiles_whole_on_the_kernels(triton_device):
    """The model with the Triton kernels (on the CPU under the interpreter: ~25 s)."""
    _check_model(_model("gdn").to(triton_device), tol=1e-5)
