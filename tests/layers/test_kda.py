"""KimiDeltaAttention layer: decode = one pass, padding/packing isolation, the formula, transformers' Kimi Linear."""
from __future__ import annotations

import pytest
import torch

from gdn.layers import KimiDeltaAttention
from gdn.ops.gates import kda_gate
from gdn.ops.kda import reference as kda_reference


def rel(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm()) if torch.isfinite(x).all() else float("inf")


def make(**kw):
    torch.manual_seed(0)
    args = dict(hidden_size=32, num_heads=2, head_dim=8, num_v_heads=4, expand_v=1.5, layer_idx=0)
    args.update(kw)
    layer = KimiDeltaAttention(**args).double().eval()
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return layer


def test_decode_equals_one_pass():
    layer = make()
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    with torch.no_grad():
        full, _ = layer(x)
        o, st = layer(x[:, :9], use_cache=True)
        outs = [o]
        for t in range(9, 21):
            o, st = layer(x[:, t : t + 1], state=st, use_cache=True)
            outs.append(o)
    assert st.recurrent.shape == (2, 4, 8, 12)
    assert rel(torch.cat(outs, 1), full) < 1e-6  # fp32 L2 norm inside the layer


def test_left_padding_and_packing_isolate_sequences():
    layer = make()
    x = torch.randn(2, 15, 32, dtype=torch.float64)
    mask = torch.ones(2, 15, dtype=torch.long)
    mask[0, :6] = 0
    with torch.no_grad():
        padded, _ = layer(x, attention_mask=mask)
        alone, _ = layer(x[:1, 6:])
        assert rel(padded[:1, 6:], alone) < 1e-6
        packed, _ = layer(torch.cat([x[0, 6:], x[1]])[None], cu_seqlens=torch.tensor([0, 9, 24]))
        second, _ = layer(x[1:])
        assert rel(packed[:, :9], alone) < 1e-6 and rel(packed[:, 9:], second) < 1e-6


def test_formula():
    """o = o_proj(RMSNorm(KDA(l2(conv q), l2(conv k), conv v, g, β)) · sigmoid(g_b g_a x))."""
    layer = make(use_short_conv=False)
    x = torch.randn(1, 7, 32, dtype=torch.float64)
    F = torch.nn.functional
    q = F.normalize(F.silu(layer.q_proj(x)).view(1, 7, 2, 8), dim=-1, eps=0)
    k = F.normalize(F.silu(layer.k_proj(x)).view(1, 7, 2, 8), dim=-1, eps=0)
    v = F.silu(layer.v_proj(x)).view(1, 7, 4, 12)
    g = -layer.A_log.exp().view(4, 1) * F.softplus(layer.f_b_proj(layer.f_a_proj(x)).view(1, 7, 4, 8)
                                                    + layer.dt_bias.view(4, 8))
    o, _ = kda_reference.kimi_delta_attention(q, k, v, g, torch.sigmoid(layer.b_proj(x)))
    o = o / o.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * layer.out_norm.weight
    o = o * torch.sigmoid(layer.g_b_proj(layer.g_a_proj(x)).view(1, 7, 4, 12))
    with torch.no_grad():
        out, _ = layer(x)
    assert rel(out, layer.o_proj(o.reshape(1, 7, 48))) < 1e-6  # l2 eps 1e-6 vs exact normalisation


def test_gradients_flow_to_gate_parameters():
    layer = make().float().train()
    out, _ = layer(torch.randn(2, 40, 32))
    out.pow(2).mean().backward()
    for name in ("A_log", "dt_bias", "f_a_proj.weight", "f_b_proj.weight", "g_a_proj.weight", "b_proj.weight"):
        grad = dict(layer.named_parameters())[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_gate_is_nonpositive_and_bad_args():
    g = kda_gate(torch.randn(2, 3, 4, 8) * 5, torch.randn(4), torch.randn(32))
    assert g.shape == (2, 3, 4, 8) and (g <= 0).all()
    with pytest.raises(ValueError, match="gate_low_rank_dim"):
        KimiDeltaAttention(32, 2, 8, gate_low_rank_dim=0)


def test_matches_transformers_kimi_linear_layer():
    """With Kimi Linear's weights mapped over, the layer computes what transformers' layer does."""
    tkl = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers import KimiLinearConfig

    cfg = KimiLinearConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, linear_num_heads=4, linear_head_dim=8,
                           linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(1)
    hf = tkl.KimiLinearDeltaAttention(cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    ours = KimiDeltaAttention(32, 4, 8, norm_eps=cfg.rms_norm_eps, layer_idx=0).eval()
    conv = hf.conv1d.weight.squeeze(1).split(32)
    sd = {"q_proj.weight": hf.q_proj.weight, "k_proj.weight": hf.k_proj.weight, "v_proj.weight": hf.v_proj.weight,
          "q_conv.weight": conv[0], "k_conv.weight": conv[1], "v_conv.weight": conv[2],
          "f_a_proj.weight": hf.forget_gate.f_a_proj.weight, "f_b_proj.weight": hf.forget_gate.f_b_proj.weight,
          "A_log": hf.forget_gate.A_log.view(-1), "dt_bias": hf.forget_gate.dt_bias, "b_proj.weight": hf.b_proj.weight,
          "g_a_proj.weight": hf.g_a_proj.weight, "g_b_proj.weight": hf.g_b_proj.weight,
          "out_norm.weight": hf.o_norm.weight, "o_proj.weight": hf.o_proj.weight}
    ours.load_state_dict(sd, strict=True)
    x = torch.randn(2, 30, 32)
    with torch.no_grad():
        assert rel(ours(x)[0], hf(x)) < 1e-5
