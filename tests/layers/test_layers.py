"""Layers: chunked forward = token-by-token recurrence; pieces = one pass; padding and packing
never leak between sequences; the blocks match their formulas."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gdn import ops
from gdn.layers import (Attention, DeltaNet, GatedDeltaNet, GatedLinearAttention, GatedRMSNorm, KimiDeltaAttention,
                        LinearAttention, RMSNorm, ShortConvolution, SwiGLU, rotary)

D = 32
RECURRENT = [GatedDeltaNet, DeltaNet, GatedLinearAttention, LinearAttention]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def make(cls, **kw):
    torch.manual_seed(0)
    if cls is Attention:
        kw = {"num_kv_heads": 2, **kw}
        return cls(D, 4, **kw).eval()
    kw = {"num_v_heads": 4, "expand_v": 1.5, **kw}
    return cls(D, 2, 16, **kw).eval()


MIXERS = [(cls, {}) for cls in RECURRENT] + [
    (GatedDeltaNet, {"use_short_conv": False, "use_gate": False, "num_v_heads": 2, "expand_v": 1.0}),
    (GatedDeltaNet, {"allow_neg_eigval": True}),
    (Attention, {}),
    (Attention, {"window_size": 7}),
    (Attention, {"output_gate": True, "qk_norm": True, "partial_rotary_factor": 0.5}),
    (Attention, {"output_gate": True, "qk_norm": True, "partial_rotary_factor": 0.25, "window_size": 7}),
]
IDS = [f"{c.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for c, kw in MIXERS]


def run_pieces(m, x, sizes, mask=None):
    state, outs, s = None, [], 0
    for n in sizes:
        o, state = m(x[:, s:s + n], attention_mask=None if mask is None else mask[:, s:s + n], state=state,
                     use_cache=True)
        outs.append(o)
        s += n
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("cls,kw", MIXERS, ids=IDS)
def test_decode_token_by_token_equals_chunked_forward(cls, kw):
    m = make(cls, **kw)
    x = torch.randn(2, 70, D)  # crosses a 64-token chunk boundary
    with torch.no_grad():
        full, _ = m(x)
        step, _ = run_pieces(m, x, [1] * 70)
    assert rel(step, full) < 1e-5


@pytest.mark.parametrize("cls,kw", MIXERS, ids=IDS)
def test_prefill_in_pieces_equals_one_pass(cls, kw):
    m = make(cls, **kw)
    x = torch.randn(2, 75, D)
    with torch.no_grad():
        full, s_full = m(x, use_cache=True)
        pieces, s_pieces = run_pieces(m, x, [5, 1, 30, 3, 36])
    assert rel(pieces, full) < 1e-5
    if cls is Attention:
        assert torch.allclose(s_pieces.key, s_full.key, atol=1e-6) and s_pieces.seen == s_full.seen == 75
    else:
        assert rel(s_pieces.recurrent, s_full.recurrent) < 1e-5
        for a, b in zip(s_pieces.conv, s_full.conv):
            assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("cls,kw", MIXERS, ids=IDS)
def test_left_padded_batch_equals_each_sequence_alone(cls, kw):
    m = make(cls, **kw)
    lens, T = [20, 13, 5], 20
    xs = [torch.randn(1, L, D) for L in lens]
    x = torch.randn(len(lens), T, D) * 100  # garbage in the padding: it must not matter
    mask = torch.zeros(len(lens), T, dtype=torch.long)
    for i, (L, xi) in enumerate(zip(lens, xs)):
        x[i, T - L:] = xi[0]
        mask[i, T - L:] = 1
    more = torch.randn(len(lens), 4, D)
    with torch.no_grad():
        o, state = m(x, attention_mask=mask, use_cache=True)
        cont, _ = run_pieces_from(m, more, state)
        for i, (L, xi) in enumerate(zip(lens, xs)):
            oi, si = m(xi, use_cache=True)
            assert rel(o[i, T - L:], oi[0]) < 1e-5
            ci, _ = run_pieces_from(m, more[i:i + 1], si)
            assert rel(cont[i], ci[0]) < 1e-5


def run_pieces_from(m, x, state):
    """Continue from ``state`` one token at a time."""
    outs = []
    for t in range(x.shape[1]):
        o, state = m(x[:, t:t + 1], state=state, use_cache=True)
        outs.append(o)
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("cls,kw", MIXERS, ids=IDS)
def test_packed_equals_separate(cls, kw):
    m = make(cls, **kw)
    lens = [9, 1, 30, 70]
    xs = [torch.randn(1, L, D) for L in lens]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    with torch.no_grad():
        packed, state = m(torch.cat(xs, 1), cu_seqlens=cu, use_cache=cls is not Attention)
        for i, xi in enumerate(xs):
            oi, si = m(xi, use_cache=cls is not Attention)
            assert rel(packed[:, cu[i]:cu[i + 1]], oi) < 1e-5
            if cls is not Attention:
                assert rel(state.recurrent[i:i + 1], si.recurrent) < 1e-5
                for a, b in zip(state.conv, si.conv):
                    assert torch.allclose(a[i:i + 1], b, atol=1e-6)


@pytest.mark.parametrize("cls,kw", [(c, {}) for c in RECURRENT + [Attention]]
                         + [(Attention, {"output_gate": True, "qk_norm": True, "partial_rotary_factor": 0.5})])
def test_gradients_reach_every_parameter(cls, kw):
    m = make(cls, **kw).train()
    x = torch.randn(2, 12, D, requires_grad=True)
    o, _ = m(x, attention_mask=torch.tensor([[0, 0] + [1] * 10, [1] * 12]))
    o.square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_gated_deltanet_matches_reference_recurrence():
    """The layer's core is exactly: L2 norm, g = −exp(A_log)·softplus(a + dt_bias), β = σ(b), recurrence."""
    torch.manual_seed(1)
    B, T, H, HV, K, V = 2, 19, 2, 4, 8, 12
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v, a, b = torch.randn(B, T, HV, V), torch.randn(B, T, HV), torch.randn(B, T, HV)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)
    o, S = ops.gated_delta_rule_fused(q, k, v, a, b, A_log, dt_bias, output_final_state=True)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    o_ref, S_ref = ops.gated_delta_rule(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, b.sigmoid(),
                                        output_final_state=True, backend="naive")
    assert rel(o, o_ref) < 1e-5 and rel(S, S_ref) < 1e-5
    o2, _ = ops.gated_delta_rule_fused(q, k, v, a, b, A_log, dt_bias, allow_neg_eigval=True)
    o2_ref, _ = ops.gated_delta_rule(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, 2 * b.sigmoid(),
                                     backend="naive")
    assert rel(o2, o2_ref) < 1e-5


def test_gate_parameter_initialisation():
    m = GatedDeltaNet(64, 4, 16, num_v_heads=256)
    A = m.A_log.exp()
    assert A.min() >= 0.01 - 1e-6 and A.max() <= 16 + 1e-4
    dt = F.softplus(m.dt_bias)
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    assert m.A_log._no_weight_decay and m.dt_bias._no_weight_decay and m.o_norm.weight._no_weight_decay
    assert m.A_log.dtype == torch.float32


def test_attention_matches_reference_softmax_with_rope():
    torch.manual_seed(2)
    m = make(Attention, window_size=5)
    x = torch.randn(2, 23, D)
    o, _ = m(x)
    B, T = 2, 23
    q = rotary(m.q_proj(x).view(B, T, 4, 8), torch.arange(T), m.rope_theta)
    k = rotary(m.k_proj(x).view(B, T, 2, 8), torch.arange(T), m.rope_theta)
    v = m.v_proj(x).view(B, T, 2, 8)
    ref = m.o_proj(ops.softmax_attention(q, k, v, window_size=5, backend="naive").reshape(B, T, 32))
    assert rel(o, ref) < 1e-5


def test_gated_attention_matches_its_formula():
    """q/k RMSNorm per head before RoPE on the first rotary_dim channels only, then
    ``o_proj(attention ⊙ sigmoid(g_proj x))``."""
    torch.manual_seed(5)
    m = make(Attention, output_gate=True, qk_norm=True, partial_rotary_factor=0.5, norm_eps=1e-5)
    with torch.no_grad():
        for norm in (m.q_norm, m.k_norm):
            norm.weight.uniform_(0.5, 1.5)
    assert m.rotary_dim == 4
    B, T = 2, 23
    x = torch.randn(B, T, D)
    with torch.no_grad():
        o, _ = m(x)

        def prep(proj, norm, H):
            h = proj(x).view(B, T, H, 8)
            h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
            return torch.cat([rotary(h[..., :4], torch.arange(T), m.rope_theta), h[..., 4:]], -1)

        q, k, v = prep(m.q_proj, m.q_norm, 4), prep(m.k_proj, m.k_norm, 2), m.v_proj(x).view(B, T, 2, 8)
        att = ops.softmax_attention(q, k, v, backend="naive").reshape(B, T, 32)
        assert rel(o, m.o_proj(att * torch.sigmoid(m.g_proj(x)))) < 1e-5
        m.g_proj.weight.zero_()  # sigmoid(0) = 1/2: half the ungated output
        assert rel(m(x)[0], m.o_proj(att / 2)) < 1e-5


def test_rotary_partial_rotates_the_leading_channels_only():
    torch.manual_seed(6)
    x, pos = torch.randn(2, 5, 3, 16), torch.arange(5)
    out = rotary(x, pos, 1e4, rotary_dim=6)
    assert torch.equal(out[..., 6:], x[..., 6:])
    assert torch.allclose(out[..., :6], rotary(x[..., :6], pos, 1e4), atol=1e-6)
    assert torch.equal(rotary(x, pos, 1e4, rotary_dim=16), rotary(x, pos, 1e4))
    for bad in (0, 5, 18):
        with pytest.raises(ValueError, match="rotary_dim"):
            rotary(x, pos, 1e4, rotary_dim=bad)


def test_plain_attention_has_no_gate_or_qk_norm():
    m = make(Attention)
    assert m.rotary_dim == m.head_dim and not m.output_gate and not m.qk_norm
    assert sorted(n for n, _ in m.named_parameters()) == ["k_proj.weight", "o_proj.weight", "q_proj.weight",
                                                          "v_proj.weight"]


def test_rotary_is_a_rotation_with_relative_scores():
    torch.manual_seed(3)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    s1 = (rotary(q, torch.tensor([7]), 1e4) * rotary(k, torch.tensor([3]), 1e4)).sum()
    s2 = (rotary(q, torch.tensor([104]), 1e4) * rotary(k, torch.tensor([100]), 1e4)).sum()
    assert torch.allclose(s1, s2, atol=1e-4)
    assert torch.allclose(rotary(q, torch.tensor([5]), 1e4).norm(), q.norm(), atol=1e-5)


def test_sliding_window_cache_is_bounded_and_global_grows():
    x = torch.randn(1, 50, D)
    with torch.no_grad():
        _, s_win = make(Attention, window_size=7)(x, use_cache=True)
        _, s_glob = make(Attention)(x, use_cache=True)
        _, s_rec = make(GatedDeltaNet)(x, use_cache=True)
        _, s_rec_short = make(GatedDeltaNet)(x[:, :5], use_cache=True)
    assert s_win.key.shape[1] == 6 and s_glob.key.shape[1] == 50
    assert s_rec.nbytes() == s_rec_short.nbytes()
    assert s_rec.recurrent.dtype == torch.float32


def test_short_convolution_matches_conv1d_and_continues_from_state():
    torch.manual_seed(4)
    conv = ShortConvolution(6, 4, activation=None)
    x = torch.randn(2, 11, 6)
    y, st = conv(x, output_state=True)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight[:, None], groups=6).transpose(1, 2)
    assert torch.allclose(y, ref, atol=1e-6)
    assert torch.allclose(st, x[:, -3:].transpose(1, 2))
    y1, s1 = conv(x[:, :4], output_state=True)
    y2, _ = conv(x[:, 4:], state=s1, output_state=True)
    assert torch.allclose(torch.cat([y1, y2], 1), y, atol=1e-6)


def test_short_convolution_packed_and_masked_do_not_leak():
    torch.manual_seed(5)
    conv = ShortConvolution(3, 4)
    a, b = torch.randn(1, 2, 3), torch.randn(1, 6, 3)
    cu = torch.tensor([0, 2, 8])
    y, st = conv(torch.cat([a, b], 1), cu_seqlens=cu, output_state=True)
    ya, sa = conv(a, output_state=True)
    yb, sb = conv(b, output_state=True)
    assert torch.allclose(y, torch.cat([ya, yb], 1), atol=1e-6)
    assert torch.allclose(st, torch.cat([sa, sb]), atol=1e-6)
    xm = torch.cat([torch.full((1, 3, 3), 50.0), b], 1)
    ym, _ = conv(xm, mask=torch.tensor([[0, 0, 0] + [1] * 6]))
    assert torch.allclose(ym[:, 3:], yb, atol=1e-6)


def test_norms_and_swiglu_match_formulas():
    torch.manual_seed(6)
    x, g = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    n = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        n.weight.uniform_(0.5, 1.5)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * n.weight
    assert torch.allclose(n(x), ref, atol=1e-6)
    gn = GatedRMSNorm(8, eps=1e-5)
    gn.load_state_dict(n.state_dict())
    assert torch.allclose(gn(x, g), ref * F.silu(g), atol=1e-6)
    assert n(x.half()).dtype == torch.float16
    mlp = SwiGLU(8, 12)
    assert torch.allclose(mlp(x), mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))


@pytest.mark.parametrize("build", [
    lambda: GatedDeltaNet(32, 3, 16, num_v_heads=4),
    lambda: GatedDeltaNet(32, 2, 16, expand_v=0.3),
    lambda: DeltaNet(0, 2, 16),
    lambda: Attention(32, 4, 3),
    lambda: Attention(30, 4),
    lambda: Attention(32, 4, head_dim=7),
    lambda: Attention(32, 4, window_size=0),
    lambda: ShortConvolution(4, 0),
])
def test_invalid_layer_arguments_raise(build):
    with pytest.raises(ValueError):
        build()


@pytest.mark.parametrize("kw,err,match", [
    (dict(partial_rotary_factor=0.1), ValueError, "partial_rotary_factor"),  # 8 * 0.1 -> 0 channels
    (dict(partial_rotary_factor=0.375), ValueError, "partial_rotary_factor"),  # 3 channels: odd
    (dict(partial_rotary_factor=1.5), ValueError, "partial_rotary_factor"),
    (dict(partial_rotary_factor=True), ValueError, "partial_rotary_factor"),
    (dict(output_gate=1), TypeError, "output_gate"),
    (dict(qk_norm="yes"), TypeError, "qk_norm"),
])
def test_invalid_attention_options_raise(kw, err, match):
    with pytest.raises(err, match=match):
        Attention(32, 4, **kw)


def test_invalid_forward_inputs_raise():
    m = make(GatedDeltaNet)
    with pytest.raises(ValueError, match="x must have shape"):
        m(torch.randn(2, 5, D + 1))
    with pytest.raises(ValueError, match="attention_mask"):
        m(torch.randn(2, 5, D), attention_mask=torch.ones(2, 4))
    _, st = m(torch.randn(2, 5, D), use_cache=True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(torch.randn(1, 5, D), cu_seqlens=torch.tensor([0, 5]), state=st)
    with pytest.raises(ValueError, match="KV cache"):
        make(Attention)(torch.randn(1, 5, D), cu_seqlens=torch.tensor([0, 5]), use_cache=True)


def test_masked_tokens_leave_recurrent_state_unchanged():
    """Padding in the middle of a cached stream (k = v = 0, g = 0) is a no-op for the state."""
    m = make(GatedDeltaNet, use_short_conv=False)
    x = torch.randn(1, 10, D)
    with torch.no_grad():
        _, s = m(x[:, :6], use_cache=True)
        _, s_pad = m(torch.randn(1, 3, D), attention_mask=torch.zeros(1, 3), state=s, use_cache=True)
    assert torch.equal(s.recurrent, s_pad.recurrent)
    assert math.isfinite(s_pad.recurrent.abs().max().item())


def test_gated_deltanet_layer_calls_the_fused_op(monkeypatch):
    """The layer hands q, k, v, the raw gate inputs and its parameters to gdn.ops.gated_delta_rule_fused
    and decides nothing itself: the op's output is the layer's mixer output."""
    calls = []
    real = ops.gated_delta_rule_fused

    def spy(*args, **kw):
        calls.append(kw.get("allow_neg_eigval"))
        return real(*args, **kw)

    monkeypatch.setattr(ops, "gated_delta_rule_fused", spy)
    m = make(GatedDeltaNet, allow_neg_eigval=True)
    m(torch.randn(1, 5, D))
    assert calls == [True]


@pytest.mark.parametrize("window", [None, 3])
def test_attention_masked_path_in_query_blocks(monkeypatch, window):
    """The explicit-mask path (padding, cache) gives the same output in blocks of 4 queries."""
    import gdn.layers.attention as attn_mod

    m = make(Attention, window_size=window)
    x = torch.randn(2, 19, D)
    mask = torch.ones(2, 19, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        ref, st = m(x[:, :7], attention_mask=mask[:, :7], use_cache=True)
        ref2, _ = m(x[:, 7:], attention_mask=mask[:, 7:], state=st, use_cache=True)
        monkeypatch.setattr(attn_mod, "QUERY_BLOCK", 4)
        out, st = m(x[:, :7], attention_mask=mask[:, :7], use_cache=True)
        out2, _ = m(x[:, 7:], attention_mask=mask[:, 7:], state=st, use_cache=True)
    assert rel(out, ref) < 1e-6 and rel(out2, ref2) < 1e-6


def _grads_of(m, x):
    x = x.clone().requires_grad_(True)
    o, _ = m(x, attention_mask=torch.tensor([[0, 0] + [1] * 10, [1] * 12]))
    o.square().sum().backward()
    return [o.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("cls", RECURRENT + [KimiDeltaAttention])
def test_input_projections_run_as_one_product(cls, monkeypatch):
    """The input projections of x run as one product of their joined weights (one F.linear call in
    the forward), with the per-layer result and gradients (fp64: equal to rounding)."""
    m = make(cls).double().train()
    x = torch.randn(2, 12, D, dtype=torch.float64)
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    joined = _grads_of(m, x)
    outs = sum(getattr(m, n).out_features for n in m.input_projections())
    # x read by one product, of the joined weight with its rows padded to a multiple of 8
    assert calls[0] == (outs + -outs % 8, D) and sum(1 for s in calls if s[1] == D) == 1, calls
    m.zero_grad()
    monkeypatch.setattr("gdn.layers.recurrent.joinable", lambda mods: False)
    each = _grads_of(m, x)
    for a, b in zip(joined, each):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), (a - b).abs().max()


def test_swiglu_gate_and_up_run_as_one_product(monkeypatch):
    """SwiGLU's gate and up projections run as one product of their joined weights, whose gradient
    its backward writes whole (no concatenation of the two halves' gradients), with the per-layer
    result and gradients (fp64: equal to rounding); a hooked projection keeps its own forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    mlp = SwiGLU(8, 12).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)

    def run():
        xr = x.clone().requires_grad_(True)
        calls = []
        real = F.linear
        monkeypatch.setattr(F, "linear", lambda *a, **kw: calls.append(tuple(a[1].shape)) or real(*a, **kw))
        y = mlp(xr)
        monkeypatch.setattr(F, "linear", real)
        ops = Ops()
        with ops:
            y.square().sum().backward()
        grads = [xr.grad] + [p.grad.clone() for p in mlp.parameters()]
        mlp.zero_grad()
        return y.detach(), grads, calls, ops.names

    y, grads, calls, bwd = run()
    assert calls == [(24, 8), (8, 12)], calls  # gate and up: one product; then down
    assert "aten.cat.default" not in bwd, bwd
    h = mlp.up_proj.register_forward_hook(lambda mod, inp, out: out)
    y2, grads2, calls2, _ = run()
    h.remove()
    assert calls2 == [(12, 8), (12, 8), (8, 12)], calls2
    assert torch.allclose(y, y2, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, grads2):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), (a - b).abs().max()


def test_a_hooked_or_wrapped_projection_keeps_its_own_forward():
    """A forward hook on one input projection, or a layer replaced by a wrapper (as a LoRA adapter
    replaces it), is honoured: the layers are then called one by one."""
    m = make(GatedDeltaNet).double()
    x = torch.randn(2, 12, D, dtype=torch.float64)
    base, _ = m(x)
    h = m.v_proj.register_forward_hook(lambda mod, inp, out: out * 0)
    hooked, _ = m(x)
    h.remove()
    assert rel(hooked, base) > 0.1

    class Scaled(torch.nn.Module):  # a wrapper exposing the layer's weight, as adapters do
        def __init__(self, lin):
            super().__init__()
            self.lin, self.weight, self.out_features = lin, lin.weight, lin.out_features

        def forward(self, t):
            return 2 * self.lin(t)

    m.k_proj = Scaled(m.k_proj)
    wrapped, _ = m(x)
    m.k_proj = m.k_proj.lin
    assert rel(wrapped, base) > 1e-3 and torch.allclose(m(x)[0], base, rtol=1e-12, atol=1e-12)
