"""The lean decode step's parts on the CPU: the fused projection weights (equal to the separate
layers in fp64, refreshed when a weight changes), the one-convolution tails, the in-place state ops,
and every preset's static decode against one full forward."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from gdn import ops
from gdn.generation import decode_step, prefill
from gdn.layers.fused import FusedLinear, FusedWeight
from gdn.models import PRESETS, GDNConfig, GDNForCausalLM, GraphDecoder, StaticCache
from gdn.ops.conv import conv_step_, short_conv

PATTERN = "GDMLKAS"  # every mixer letter


def model(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    kw = {"hidden_size": 32, "num_hidden_layers": len(PATTERN), "layer_pattern": PATTERN, "head_dim": 16,
          "intermediate_size": 64, "window_size": 4, "attention_output_gate": True, **kw}
    return GDNForCausalLM(GDNConfig.from_preset("gdn", "tiny", **kw)).to(dtype).eval()


def fused_parts(block):
    """(module, FusedLinear) of a block's mixer and MLP."""
    mixer_w, mlp_w = block.decode_weights()
    proj = mixer_w[0] if isinstance(mixer_w, tuple) else mixer_w
    return [(block.mixer, proj), (block.mlp, mlp_w)]


def test_fused_projection_equals_separate():
    """fp64: every projection of every mixer kind and the MLP's gate/up, from one GEMM, equal the
    separate layers to 1e-12; q, k, v lead a mixer's projections."""
    m = model()
    x = torch.randn(3, 1, 32, dtype=torch.float64)
    for block in m.model.layers:
        for module, fused in fused_parts(block):
            out = fused(x)
            assert list(out) == list(fused.names)
            assert fused.weight.shape == (sum(fused.sizes), 32) and not fused.weight.requires_grad
            for name, y in out.items():
                torch.testing.assert_close(y, getattr(module, name)(x), rtol=0, atol=1e-12)
        names = fused_parts(block)[0][1].names
        assert names[:3] == ("q_proj", "k_proj", "v_proj")
        assert set(names) == {n for n, c in block.mixer.named_children() if isinstance(c, nn.Linear)
                              and c.in_features == 32 and n != "o_proj"}


def test_fused_weight_refresh():
    """An in-place write (no_grad add_, load_state_dict) or a new parameter is copied in by refresh,
    into the same storage; an unchanged model copies nothing."""
    a, b = nn.Linear(8, 4, bias=False).double(), nn.Linear(8, 6, bias=False).double()
    fused = FusedLinear({"a": a, "b": b})
    ptr = fused.weight.data_ptr()
    assert not fused.refresh()
    x = torch.randn(2, 8, dtype=torch.float64)
    with torch.no_grad():
        a.weight.add_(1.0)
    assert fused.refresh()
    torch.testing.assert_close(fused(x)["a"], a(x), rtol=0, atol=1e-12)
    b.load_state_dict({"weight": torch.randn(6, 8, dtype=torch.float64)})
    assert fused.refresh()
    torch.testing.assert_close(fused(x)["b"], b(x), rtol=0, atol=1e-12)
    b.weight = nn.Parameter(torch.randn(6, 8, dtype=torch.float64))
    assert fused.refresh() and not fused.refresh()
    torch.testing.assert_close(fused(x)["b"], b(x), rtol=0, atol=1e-12)
    assert fused.weight.data_ptr() == ptr
    with pytest.raises(ValueError, match="bias-free"):
        FusedLinear({"a": nn.Linear(8, 4)})


def test_decoder_sees_weight_changes():
    """A GraphDecoder built before the weights change decodes with the new weights at its next start
    (its fused copies are refreshed in place): logits equal the eager decode's."""
    m = model()
    ids = torch.randint(1, m.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    dec = GraphDecoder(m, max_length=16)
    _, cache = prefill(m, ids)
    dec.start(cache)
    dec.step(ids[:, -1])
    ptrs = [w.weight.data_ptr() for block_w in dec.weights.layers for w in _flat(block_w)]
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("proj.weight") or "conv" in name:
                p.mul_(1.5)
    _, cache = prefill(m, ids)
    dec.start(cache.snapshot())
    tok = ids[:, -1]
    for _ in range(3):
        a, b = decode_step(m, tok, cache), dec.step(tok)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)
        tok = a.argmax(-1)
    assert [w.weight.data_ptr() for block_w in dec.weights.layers for w in _flat(block_w)] == ptrs


def _flat(parts):
    if isinstance(parts, FusedWeight):
        return [parts]
    return [w for p in parts if p is not None for w in _flat(p)]


def test_conv_step_equals_short_conv():
    """One token through conv_step_: short_conv's output with that history, and the tails rolled by
    one in place."""
    x = torch.randn(3, 1, 10, dtype=torch.float64)
    w = torch.randn(10, 4, dtype=torch.float64)
    tails = torch.randn(3, 10, 3, dtype=torch.float64)
    ref = short_conv(x, w, tails.clone(), None, "silu")
    expect = torch.cat([tails[..., 1:], x.transpose(1, 2)], -1)
    ptr = tails.data_ptr()
    y = conv_step_(x, w, tails, "silu")
    assert torch.equal(y, ref) and torch.equal(tails, expect) and tails.data_ptr() == ptr


@pytest.mark.parametrize("member", ["gated_delta_rule", "delta_rule", "gated_linear_attention", "linear_attention"])
def test_recurrent_step_in_place(member):
    """recurrent_step_ gives the op's output and writes its final state into the given state."""
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.nn.functional.normalize(torch.randn(3, 1, 2, 8, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(3, 1, 4, 8, generator=gen, dtype=torch.float64)
    g = -torch.rand(3, 1, 4, generator=gen, dtype=torch.float64) if "gated" in member else None
    beta = torch.rand(3, 1, 4, generator=gen, dtype=torch.float64) if "delta" in member else None
    S0 = torch.randn(3, 4, 8, 8, generator=gen, dtype=torch.float64)
    args = [x for x in (g, beta) if x is not None]
    o_ref, S_ref = getattr(ops, member)(q, k, v, *args, initial_state=S0, output_final_state=True)
    state = S0.clone()
    o = ops.recurrent_step_(q, k, v, g, beta, state)
    assert torch.equal(o, o_ref) and torch.equal(state, S_ref)
    with pytest.raises(ValueError, match="one token"):
        ops.recurrent_step_(q.expand(3, 2, 2, 8), k.expand(3, 2, 2, 8), v.expand(3, 2, 4, 8), None, None, state)


def test_fused_step_in_place():
    """gated_delta_rule_fused_step_ equals gated_delta_rule_fused with the state copied in; refuses grad."""
    gen = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 1, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 1, 4, 8, generator=gen, dtype=torch.float64)
    a, b = (torch.randn(2, 1, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    A_log, dt_bias = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    S0 = torch.randn(2, 4, 8, 8, generator=gen, dtype=torch.float64)
    o_ref, S_ref = ops.gated_delta_rule_fused(q, k, v, a, b, A_log, dt_bias, initial_state=S0, output_final_state=True,
                                              allow_neg_eigval=True)
    state = S0.clone()
    o = ops.gated_delta_rule_fused_step_(q, k, v, a, b, A_log, dt_bias, state, allow_neg_eigval=True)
    assert torch.equal(o, o_ref) and torch.equal(state, S_ref)
    with pytest.raises(ValueError, match="no backward"):
        ops.gated_delta_rule_fused_step_(q, k, v, a, b, A_log.requires_grad_(), dt_bias, state)


def test_no_short_conv_decode():
    """Mixers without short convolutions (SiLU only): the static step equals the eager decode."""
    m = model(use_short_conv=False)
    ids = torch.randint(1, m.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    logits, cache = prefill(m, ids)
    static = StaticCache(m, 2, 16)
    static.load(cache.snapshot())
    assert all(st.tails is None for st in static.layers if hasattr(st, "tails"))
    dec = GraphDecoder(m, max_length=16)
    dec.start(cache.snapshot())
    tok = logits.argmax(-1)
    for _ in range(4):
        a, b = decode_step(m, tok, cache), dec.step(tok)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)
        tok = a.argmax(-1)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_static_decode_equals_full_forward(preset):
    """Every preset (tiny, fp64): the tokens the static decoder picks greedily are the argmax of one
    full forward over the prompt and those tokens, and equal the eager decode's."""
    torch.manual_seed(0)
    m = GDNForCausalLM(GDNConfig.from_preset(preset, "tiny", num_hidden_layers=2, hidden_size=64,
                                             intermediate_size=128)).double().eval()
    ids = torch.randint(1, m.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(4))
    logits, cache = prefill(m, ids)
    dec = GraphDecoder(m, max_length=20)
    dec.start(cache.snapshot())
    tok_e = tok_s = logits.argmax(-1)
    seq = [tok_s]
    for _ in range(8):
        tok_e = decode_step(m, tok_e, cache).argmax(-1)
        tok_s = dec.step(tok_s).argmax(-1)
        assert torch.equal(tok_e, tok_s)
        seq.append(tok_s)
    out = torch.cat([ids, torch.stack(seq, 1)], 1)
    with torch.no_grad():
        full = m(out[:, :-1]).logits
    assert torch.equal(full[:, ids.shape[1] - 1:].argmax(-1), out[:, ids.shape[1]:])
