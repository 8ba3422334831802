"""gdn.compat.fla: FLA's signatures and semantics, and the one-line switch for transformers' layers."""
from __future__ import annotations

import pytest
import torch

from gdn.compat import fla
from gdn.ops.delta import reference
from gdn.ops.kda import reference as kda_reference

from .tiny import qwen3_5_config, qwen3_next_config, randomize, rel

tq35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
tqn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
tkl = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _inputs(B=2, T=37, H=2, HV=4, K=8, V=12, seed=0, per_channel=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen).to(dtype)

    g_shape = (B, T, HV, K) if per_channel else (B, T, HV)
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V),
                g=(-torch.rand(*g_shape, generator=gen) * 0.7).to(dtype),
                beta=torch.rand(B, T, HV, generator=gen).to(dtype), S0=torch.randn(B, HV, K, V, generator=gen))


@pytest.mark.parametrize("T", [1, 37, 70])
def test_chunk_matches_transformers_fallback(T):
    d = _inputs(T=T)
    ref_o, ref_S = tq35.torch_chunk_gated_delta_rule(d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"],
                                                     initial_state=d["S0"], output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
    o, S = fla.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["S0"],
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == d["q"].dtype and S.dtype == torch.float32
    assert rel(o, ref_o) < 1e-5 and rel(S, ref_S) < 1e-5


def test_recurrent_matches_transformers_fallback():
    d = _inputs(T=5)
    ref_o, ref_S = tq35.torch_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"],
                                                         initial_state=d["S0"], output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
    o, S = fla.fused_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], beta=d["beta"],
                                                initial_state=d["S0"], output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    assert rel(o, ref_o) < 1e-5 and rel(S, ref_S) < 1e-5


def test_positional_order_scale_and_no_state():
    """FLA's positional order: q, k, v, g, beta, scale, initial_state, output_final_state."""
    d = _inputs(T=9)
    o, S = fla.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], 0.3, d["S0"], True)
    ref_o, ref_S = reference.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=0.3,
                                              initial_state=d["S0"], output_final_state=True)
    assert rel(o, ref_o) < 1e-5 and rel(S, ref_S) < 1e-5
    o2, S2 = fla.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"])
    assert S2 is None and o2.shape == d["v"].shape


def test_in_kernel_gate_beta_and_state_v_first():
    d = _inputs(T=11)
    HV = d["v"].shape[2]
    A_log, dt_bias, a, b = torch.randn(HV), torch.randn(HV), torch.randn_like(d["g"]), torch.randn_like(d["beta"])
    o, S = fla.chunk_gated_delta_rule(d["q"], d["k"], d["v"], a, b, initial_state=d["S0"].transpose(-1, -2),
                                      output_final_state=True, use_gate_in_kernel=True, A_log=A_log,
                                      dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                      state_v_first=True)
    g = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    ref_o, ref_S = reference.gated_delta_rule(d["q"], d["k"], d["v"], g, 2 * torch.sigmoid(b),
                                              initial_state=d["S0"], output_final_state=True)
    assert rel(o, ref_o) < 1e-5 and rel(S.transpose(-1, -2), ref_S) < 1e-5


def test_recurrent_optional_gates_and_gk():
    d = _inputs(T=6)
    o, _ = fla.fused_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], beta=d["beta"])
    ref, _ = reference.delta_rule(d["q"], d["k"], d["v"], d["beta"])
    assert rel(o, ref) < 1e-5
    o, _ = fla.fused_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], d["g"])
    ref, _ = reference.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], torch.ones_like(d["beta"]))
    assert rel(o, ref) < 1e-5
    gk = -torch.rand(*d["g"].shape, 8) * 0.5
    o, _ = fla.fused_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], g=d["g"], gk=gk, beta=d["beta"])
    ref, _ = kda_reference.kimi_delta_attention(d["q"], d["k"], d["v"], gk + d["g"][..., None], d["beta"])
    assert rel(o, ref) < 1e-5


def test_packed_sequences():
    d = _inputs(B=1, T=40)
    cu = torch.tensor([0, 13, 13, 40])
    S0 = torch.randn(3, 4, 8, 12)
    o, S = fla.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=S0,
                                      output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    for n, (s, e) in enumerate([(0, 13), (13, 13), (13, 40)]):
        if e > s:
            o_n, S_n = fla.fused_recurrent_gated_delta_rule(
                d["q"][:, s:e], d["k"][:, s:e], d["v"][:, s:e], d["g"][:, s:e], beta=d["beta"][:, s:e],
                initial_state=S0[n : n + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
            assert rel(o[:, s:e], o_n) < 1e-5
        else:
            S_n = S0[n : n + 1]
        assert rel(S[n : n + 1], S_n) < 1e-5


def test_bad_arguments():
    d = _inputs(T=4)
    q, k, v, g, b = d["q"], d["k"], d["v"], d["g"], d["beta"]
    with pytest.raises(ValueError, match="cp_context"):
        fla.chunk_gated_delta_rule(q, k, v, g, b, cp_context=object())
    with pytest.raises(ValueError, match="gv"):
        fla.fused_recurrent_gated_delta_rule(q, k, v, g, gv=torch.zeros_like(v), beta=b)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        fla.chunk_gated_delta_rule(q, k, v, g, b, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="A_log"):
        fla.chunk_gated_delta_rule(q, k, v, g, b, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="g must have shape"):
        fla.chunk_gated_delta_rule(q, k, v, g[:, :3], b)
    with pytest.raises(ValueError, match="g must have shape"):
        fla.chunk_kda(q, k, v, g, b)
    with pytest.raises(ValueError, match="models"):
        fla.patch_transformers(["llama"])


def test_kda_matches_transformers_fallback():
    d = _inputs(T=45, H=4, HV=4, K=8, V=8, per_channel=True)
    for fn_t, fn_g in ((tkl.chunk_kimi_delta_attention, fla.chunk_kda),
                       (tkl.recurrent_kimi_delta_attention, fla.fused_recurrent_kda)):
        ref_o, ref_S = fn_t(d["q"], d["k"], d["v"], g=d["g"], beta=d["beta"], initial_state=d["S0"],
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
        o, S = fn_g(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["S0"], output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
        assert rel(o, ref_o) < 1e-5 and rel(S, ref_S) < 1e-5


def _layer_outputs(layer, x, mask=None):
    with torch.no_grad():
        ref = layer(x, attention_mask=mask)
        with fla.patch_transformers() as patch:
            assert any("torch_chunk_gated_delta_rule" in p for p in patch.patched)
            out = layer(x, attention_mask=mask)
    return ref, out


def _qwen3_5_moe_layer():
    tq35m = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from transformers import Qwen3_5MoeTextConfig

    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "linear_conv_kernel_dim",
            "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "layer_types", "num_hidden_layers")
    base = qwen3_5_config()
    return tq35m.Qwen3_5MoeGatedDeltaNet(Qwen3_5MoeTextConfig(**{k: getattr(base, k) for k in keys}), 0)


@pytest.mark.parametrize("make", [lambda: tq35.Qwen3_5GatedDeltaNet(qwen3_5_config(), 0),
                                  lambda: tqn.Qwen3NextGatedDeltaNet(qwen3_next_config(), 0), _qwen3_5_moe_layer],
                         ids=["qwen3.5", "qwen3-next", "qwen3.5-moe"])
def test_transformers_gated_delta_layer_equivalence(make):
    torch.manual_seed(0)
    layer = randomize(make()).eval()
    x = torch.randn(2, 70, 32)
    ref, out = _layer_outputs(layer, x)
    assert rel(out, ref) < 1e-5
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[1, :9] = 0
    ref, out = _layer_outputs(layer, x, mask)
    assert rel(out, ref) < 1e-5


def test_patch_is_undone():
    original = tq35.torch_chunk_gated_delta_rule
    with fla.patch_transformers(["qwen3_5"]):
        assert tq35.torch_chunk_gated_delta_rule is fla.chunk_gated_delta_rule
        assert tqn.torch_chunk_gated_delta_rule is not fla.chunk_gated_delta_rule
    assert tq35.torch_chunk_gated_delta_rule is original


@pytest.mark.parametrize("which", ["qwen3.5", "qwen3-next"])
def test_transformers_model_logits_and_generation(which):
    """Whole models, prefill (chunk) and cached decode (recurrent) paths: same logits, same tokens."""
    from transformers import Qwen3_5ForCausalLM, Qwen3NextForCausalLM

    cls, cfg = (Qwen3_5ForCausalLM, qwen3_5_config()) if which == "qwen3.5" else (Qwen3NextForCausalLM,
                                                                                  qwen3_next_config())
    torch.manual_seed(1)
    model = randomize(cls(cfg), seed=3, std=0.3).eval()
    ids = torch.randint(3, 96, (2, 19))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref_logits, ref_gen = model(ids).logits, model.generate(ids, **kw)
        with fla.patch_transformers():
            logits, gen = model(ids).logits, model.generate(ids, **kw)
    assert rel(logits, ref_logits) < 1e-5
    assert torch.equal(gen, ref_gen)


def test_kimi_linear_layer_equivalence():
    from transformers import KimiLinearConfig

    cfg = KimiLinearConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, linear_num_heads=4, linear_head_dim=8,
                           linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])
    layer = randomize(tkl.KimiLinearDeltaAttention(cfg, 0)).eval()
    x = torch.randn(2, 40, 32)
    ref, out = _layer_outputs(layer, x)
    assert rel(out, ref) < 1e-5
