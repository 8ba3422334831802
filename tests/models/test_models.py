"""Models: every preset decodes token by token exactly as the full forward, continues from
pieces, isolates padded and packed sequences, saves and loads exactly, generates reproducibly,
trains every parameter; invalid configs fail with a message."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import gdn.models  # noqa: F401  (registers the Auto classes)
from gdn.models import (PRESETS, SIZES, GDNCache, GDNConfig, GDNForCausalLM, no_weight_decay_names, output_cache,
                        param_groups)

V = 97


def tiny(preset: str, **kw) -> GDNForCausalLM:
    torch.manual_seed(0)
    kw = {"hidden_size": 64, "vocab_size": V, **kw}
    if "S" in PRESETS[preset](4):
        kw.setdefault("window_size", 8)
    return GDNForCausalLM(GDNConfig.from_preset(preset, **kw)).eval()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def ids(B, T, seed=1):
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


def step_through(m, x, sizes, cache=None, mask=None):
    outs, s = [], 0
    for n in sizes:
        o = m(x[:, s:s + n], past_key_values=cache, use_cache=True,
              attention_mask=None if mask is None else mask[:, :s + n])
        cache = output_cache(o)
        outs.append(o.logits)
        s += n
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("preset", sorted(PRESETS))
@torch.no_grad()
def test_decode_token_by_token_equals_full_forward(preset):
    m = tiny(preset)
    x = ids(2, 70)
    full = m(x, use_cache=False).logits
    step, cache = step_through(m, x, [1] * 70)
    assert rel(step, full) < 1e-5
    assert isinstance(cache, GDNCache) and cache.get_seq_length() == 70


@pytest.mark.parametrize("preset", sorted(PRESETS))
@torch.no_grad()
def test_prefill_in_pieces_equals_one_pass(preset):
    m = tiny(preset)
    x = ids(2, 75)
    full = m(x, use_cache=False).logits
    pieces, _ = step_through(m, x, [20, 1, 3, 51])
    assert rel(pieces, full) < 1e-5


@pytest.mark.parametrize("preset", sorted(PRESETS))
@torch.no_grad()
def test_left_padded_batch_equals_each_sequence_alone(preset):
    m = tiny(preset)
    lens, T, extra = [21, 12, 4], 21, 5
    seqs = [ids(1, L + extra, seed=10 + i) for i, L in enumerate(lens)]
    batch = torch.zeros(len(lens), T + extra, dtype=torch.long)
    mask = torch.zeros(len(lens), T + extra, dtype=torch.long)
    for i, (L, s) in enumerate(zip(lens, seqs)):
        batch[i, T - L:] = s[0]
        mask[i, T - L:] = 1
    # prefill the padded prompts in one pass, then decode `extra` tokens one by one
    logits, _ = step_through(m, batch, [T] + [1] * extra, mask=mask)
    for i, (L, s) in enumerate(zip(lens, seqs)):
        alone = m(s, use_cache=False).logits[0]
        assert rel(logits[i, T - L:], alone) < 1e-5, i


@pytest.mark.parametrize("preset", sorted(PRESETS))
@torch.no_grad()
def test_packed_equals_padded(preset):
    m = tiny(preset)
    lens = [30, 3, 70]
    seqs = [ids(1, L, seed=20 + i) for i, L in enumerate(lens)]
    cu = torch.tensor([0, 30, 33, 103], dtype=torch.int32)
    packed = m(torch.cat(seqs, 1), cu_seqlens=cu).logits
    T = max(lens)
    right = torch.zeros(len(lens), T, dtype=torch.long)
    mask = torch.zeros(len(lens), T, dtype=torch.long)
    for i, (L, s) in enumerate(zip(lens, seqs)):
        right[i, :L], mask[i, :L] = s[0], 1
    padded = m(right, attention_mask=mask, use_cache=False).logits
    for i, L in enumerate(lens):
        assert rel(packed[0, cu[i]:cu[i + 1]], padded[i, :L]) < 1e-5


def test_packed_loss_does_not_predict_across_documents():
    m = tiny("gdn-h1")
    a, b = ids(1, 9, seed=3), ids(1, 6, seed=4)
    cu = torch.tensor([0, 9, 15])
    x = torch.cat([a, b], 1)
    loss = m(x, labels=x, cu_seqlens=cu).loss
    la, lb = m(a, labels=a).loss, m(b, labels=b).loss
    assert torch.allclose(loss, (la * 8 + lb * 5) / 13, atol=1e-5)


def test_loss_ignores_minus_100_and_matches_cross_entropy():
    m = tiny("qwen3next")
    x = ids(2, 12)
    labels = x.clone()
    labels[0, :5] = -100
    out = m(x, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, V)
    ref = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, ref, atol=1e-6)
    assert out.logits.dtype == torch.float32


@torch.no_grad()
def test_logits_to_keep():
    m = tiny("gdn")
    x = ids(2, 10)
    full = m(x).logits
    assert torch.allclose(m(x, logits_to_keep=3).logits, full[:, -3:], atol=1e-6)
    assert torch.allclose(m(x, logits_to_keep=torch.tensor([0, 4])).logits, full[:, [0, 4]], atol=1e-6)
    with pytest.raises(ValueError, match="logits_to_keep"):
        m(x, labels=x, logits_to_keep=1)


@pytest.mark.parametrize("tie", [False, True])
@torch.no_grad()
def test_save_load_gives_identical_logits(tmp_path, tie):
    m = tiny("deltanet-transformer", tie_word_embeddings=tie)
    x = ids(2, 17)
    before = m(x).logits
    m.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is GDNForCausalLM
    assert loaded.config.layer_pattern == m.config.layer_pattern
    assert torch.equal(loaded(x).logits, before)
    for (n1, p1), (n2, p2) in zip(m.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) == tie


def test_auto_classes_after_import():
    d = GDNConfig.from_preset("gdn-h2", hidden_size=64, vocab_size=V, window_size=8).to_dict()
    d.pop("model_type")
    cfg = AutoConfig.for_model("gdn", **d)
    assert isinstance(cfg, GDNConfig) and cfg.layer_pattern == "MGSM"
    m = AutoModelForCausalLM.from_config(cfg)
    assert isinstance(m, GDNForCausalLM)
    gdn.models.register()  # idempotent


def test_generate_greedy_and_sampling_reproducible():
    m = tiny("gdn-h1")
    x = ids(2, 9)
    mask = torch.ones_like(x)
    g1 = m.generate(x, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert g1.shape == (2, 16) and torch.equal(g1[:, :9], x)
    # greedy generate = argmax of the full forward at every step
    with torch.no_grad():
        for t in range(9, 16):
            assert torch.equal(m(g1[:, :t]).logits[:, -1].argmax(-1), g1[:, t])
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(m.generate(x, attention_mask=mask, max_new_tokens=7, do_sample=True, top_k=20, top_p=0.9,
                               temperature=1.3, pad_token_id=0))
    assert torch.equal(outs[0], outs[1])
    torch.manual_seed(7)
    other = m.generate(x, attention_mask=mask, max_new_tokens=7, do_sample=True, top_k=20, top_p=0.9,
                       temperature=1.3, pad_token_id=0)
    assert not torch.equal(outs[0], other)


def test_generate_left_padded_batch_equals_alone():
    m = tiny("qwen3next")
    a, b = ids(1, 10, seed=5), ids(1, 4, seed=6)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 6, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :6] = 0
    g = m.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    ga = m.generate(a, max_new_tokens=6, do_sample=False, pad_token_id=0)
    gb = m.generate(b, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(g[0], ga[0]) and torch.equal(g[1, 6:], gb[0])


def test_every_parameter_gets_a_gradient():
    m = tiny("gdn", num_hidden_layers=7, layer_pattern="GDMLKAS", window_size=5).train()
    x = ids(2, 20)
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    m(x, attention_mask=mask, labels=x).loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and bool(p.grad.abs().sum() > 0), name


def test_gradient_checkpointing_gives_the_same_gradients():
    m = tiny("gdn-h2").train()
    x = ids(2, 15)
    m(x, labels=x).loss.backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable  # 5.2x / 5.1x
    enable()
    assert m.model.gradient_checkpointing
    out = m(x, labels=x)
    assert output_cache(out) is None
    out.loss.backward()
    for n, p in m.named_parameters():
        assert torch.allclose(p.grad, ref[n], atol=1e-6), n


def test_initialisation_and_weight_decay_groups():
    m = tiny("gdn-h2", initializer_range=0.02)
    w = m.model.layers[1].mixer.q_proj.weight
    assert abs(w.std().item() - 0.02) < 0.004
    assert torch.equal(m.model.norm.weight, torch.ones_like(m.model.norm.weight))
    A = m.model.layers[1].mixer.A_log.exp()
    assert A.min() >= 0.01 - 1e-6 and A.max() <= 16 + 1e-4
    names = no_weight_decay_names(m)
    assert "model.layers.1.mixer.A_log" in names and "model.layers.0.mixer.dt_bias" in names
    assert "model.norm.weight" in names and "model.layers.1.mixer.o_norm.weight" in names
    assert "model.layers.1.mixer.q_proj.weight" not in names
    groups = param_groups(m, 0.1)
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert sum(len(g["params"]) for g in groups) == len(list(m.parameters()))
    assert all(getattr(p, "_no_weight_decay", False) for p in groups[1]["params"])


@torch.no_grad()
def test_cache_state_constant_for_recurrent_layers_growing_for_attention():
    m = tiny("qwen3next")  # GGGA
    _, c1 = step_through(m, ids(1, 10), [10])
    _, c2 = step_through(m, ids(1, 40), [40])
    n1, n2 = c1.layer_nbytes(), c2.layer_nbytes()
    assert n1[:3] == n2[:3] and n2[3] == 4 * n1[3]
    assert c1.is_linear == [True, True, True, False]
    assert c2.layers[0].recurrent.dtype == torch.float32
    h1 = tiny("gdn-h1")  # GSGS, window 8
    _, c3 = step_through(h1, ids(1, 40), [40])
    assert c3.layers[1].key.shape[1] == 7


def test_hidden_states_output():
    m = tiny("gdn")
    out = m(ids(1, 5), output_hidden_states=True)
    assert len(out.hidden_states) == m.config.num_hidden_layers + 1


@pytest.mark.parametrize("hidden", [False, True])
def test_model_equals_its_blocks_one_after_another(hidden):
    """The model hands (stream, MLP output) from block to block and adds each MLP output inside the
    next norm: the same as each block's forward applied in turn, then the last norm; gradients too."""
    m = tiny("gdn-h2", num_hidden_layers=3).train()
    x = ids(2, 9)
    out = m.model(x, output_hidden_states=hidden)
    out.last_hidden_state.square().sum().backward()
    got = {n: p.grad.clone() for n, p in m.model.named_parameters()}
    m.zero_grad()
    h, inputs = m.model.embed_tokens(x), []
    for block in m.model.layers:
        inputs.append(h)
        h = block(h)[0]
    ref = m.model.norm(h)
    ref.square().sum().backward()
    assert torch.equal(out.last_hidden_state, ref)
    if hidden:
        assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, inputs + [ref]))
    for n, p in m.model.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-5, atol=1e-7), n


@pytest.mark.parametrize("kw,match", [
    (dict(layer_pattern="GGXG"), "unknown letters"),
    (dict(layer_pattern="GGG"), "one letter per layer"),
    (dict(window_size=16), "no S layers"),
    (dict(num_v_heads=3), "multiple of num_heads"),
    (dict(head_dim=16, expand_v=1.3), "expand_v"),
    (dict(layer_pattern="GGAG", num_attention_heads=3, num_key_value_heads=1), "divisible by num_attention_heads"),
    (dict(layer_pattern="GGAG", num_key_value_heads=3), "num_key_value_heads"),
    (dict(layer_pattern="GGSG", window_size=None), "set window_size"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(partial_rotary_factor=0.0), "partial_rotary_factor"),
    (dict(partial_rotary_factor=2), "partial_rotary_factor"),
    (dict(layer_pattern="GGAG", partial_rotary_factor=0.05), "partial_rotary_factor"),  # 32 * 0.05 -> 1 channel
    (dict(attention_output_gate=1), "attention_output_gate"),
    (dict(attention_qk_norm="no"), "attention_qk_norm"),
])
def test_invalid_configs_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        GDNConfig.from_preset("gdn", **kw)


def test_unknown_override_lists_the_valid_keys():
    with pytest.raises(ValueError, match=r"unknown model keys \['hiden_size'\] \(did you mean hidden_size\?\); "
                                         r"valid keys: .*'hidden_size'.*'vocab_size'"):
        GDNConfig.from_preset("gdn", hiden_size=64)
    with pytest.raises(ValueError, match=r"unknown model keys \['foo', 'hiden_size'\]"):
        GDNConfig.from_preset("gdn", foo=1, hiden_size=64)
    # a saved config.json with a field this version lacks still loads
    assert GDNConfig(hidden_size=64, num_hidden_layers=1, newer_field=3).newer_field == 3


def test_unknown_preset_and_size_raise():
    with pytest.raises(ValueError, match="unknown preset"):
        GDNConfig.from_preset("mamba")
    with pytest.raises(ValueError, match="unknown size"):
        GDNConfig.from_preset("gdn", size="7b")


def test_presets_and_sizes():
    n = 24
    assert GDNConfig.from_preset("gdn", "340m").layer_pattern == "G" * n
    assert GDNConfig.from_preset("gdn-h1", "340m").layer_pattern == "GS" * 12
    assert GDNConfig.from_preset("gdn-h2", "340m").layer_pattern == "MGS" * 8
    assert GDNConfig.from_preset("qwen3next", "340m").layer_pattern == "GGGA" * 6
    dt = GDNConfig.from_preset("deltanet-transformer", "340m").layer_pattern
    assert [i + 1 for i, c in enumerate(dt) if c == "A"] == [2, n // 2 + 1]
    assert set(dt) == {"D", "S", "A"}
    for size in SIZES:
        cfg = GDNConfig.from_preset("gdn-h1", size)
        assert cfg.window_size is not None
    assert GDNConfig.from_preset("gdn", "1.3b", num_hidden_layers=6).layer_pattern == "GGGGGG"


def test_model_rejects_bad_inputs():
    m = tiny("gdn")
    with pytest.raises(ValueError, match="attention_mask"):
        m(ids(2, 5), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(ids(2, 5), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(ids(1, 5), cu_seqlens=torch.tensor([0, 5]), use_cache=True)
    with pytest.raises(TypeError, match="GDNCache"):
        m(ids(1, 5), past_key_values=object())
    with pytest.raises(ValueError, match="sequences"):
        m(ids(2, 5), past_key_values=GDNCache.for_config(m.config, 3))


@pytest.mark.parametrize("size", ["125m", "340m", "1.3b"])
def test_real_sizes_build_on_meta(size):
    with torch.device("meta"):
        m = GDNForCausalLM(GDNConfig.from_preset("gdn", size))
    assert sum(p.numel() for p in m.parameters()) > 0


def test_beam_search_with_cache_equals_without():
    m = tiny("gdn-h1")
    x = ids(2, 6)
    kw = dict(max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(m.generate(x, **kw), m.generate(x, use_cache=False, **kw))


def test_generate_from_inputs_embeds_equals_from_ids():
    m = tiny("qwen3next")
    x = ids(2, 5)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    from_embeds = m.generate(inputs_embeds=m.get_input_embeddings()(x), **kw)
    assert torch.equal(from_embeds, m.generate(x, **kw)[:, 5:])


@torch.no_grad()
def test_every_letter_decodes_like_the_full_forward():
    """All six recurrent/attention letters plus K (Kimi Delta Attention) in one stack."""
    m = tiny("gdn", num_hidden_layers=7, layer_pattern="KGDMLAS", window_size=6, kda_gate_rank=8)
    x = ids(2, 30)
    full = m(x, use_cache=False).logits
    step, cache = step_through(m, x, [1] * 30)
    assert rel(step, full) < 1e-5
    assert cache.is_linear == [True] * 5 + [False] * 2
    padded, _ = step_through(m, torch.cat([torch.zeros(2, 3, dtype=torch.long), x], 1), [33],
                             mask=torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.ones_like(x)], 1))
    assert rel(padded[:, 3:], full) < 1e-5


def test_from_pretrained_in_bf16_keeps_gate_parameters_fp32(tmp_path):
    m = tiny("gdn-h2")
    m.save_pretrained(tmp_path)
    low = GDNForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    mixer = low.model.layers[1].mixer  # G
    assert mixer.A_log.dtype == mixer.dt_bias.dtype == torch.float32
    assert torch.equal(mixer.A_log, m.model.layers[1].mixer.A_log)
    assert low.model.layers[1].mixer.q_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        ref, out = m(ids(1, 12)).logits, low(ids(1, 12)).logits.float()
    assert torch.isfinite(out).all() and rel(out, ref) < 0.05


GATED = dict(attention_output_gate=True, attention_qk_norm=True, partial_rotary_factor=0.25)


@torch.no_grad()
def test_gated_attention_options_build_decode_and_reload(tmp_path):
    """The Qwen3-Next / Qwen3.5 attention options reach every A and S layer, decode token by token
    like the full forward, and survive save_pretrained / AutoModelForCausalLM.from_pretrained."""
    m = tiny("gdn", num_hidden_layers=4, layer_pattern="GAGS", window_size=6, **GATED)
    for i in (1, 3):
        mixer = m.model.layers[i].mixer
        assert mixer.output_gate and mixer.qk_norm and mixer.rotary_dim == mixer.head_dim // 4
        assert {"g_proj.weight", "q_norm.weight", "k_norm.weight"} <= dict(mixer.named_parameters()).keys()
        assert torch.equal(mixer.q_norm.weight, torch.ones_like(mixer.q_norm.weight))  # norms start at 1
    x = ids(2, 30)
    full = m(x, use_cache=False).logits
    step, _ = step_through(m, x, [1] * 30)
    assert rel(step, full) < 1e-5
    m.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert {k: getattr(loaded.config, k) for k in GATED} == GATED
    assert torch.equal(loaded.eval()(x).logits, full)
    plain = tiny("gdn", num_hidden_layers=2, layer_pattern="GA")
    assert not hasattr(plain.model.layers[1].mixer, "g_proj")
    assert plain.model.layers[1].mixer.rotary_dim == plain.model.layers[1].mixer.head_dim


def test_beta_offset_reaches_the_layers_and_survives_save_load(tmp_path):
    """GDNConfig.beta_offset (the MQAR recipe's β initialisation) is applied by every G and D layer
    and restored by from_pretrained."""
    m = GDNForCausalLM(GDNConfig.from_preset("gdn", size="tiny", layer_pattern="GD", num_hidden_layers=2, beta_offset=-3.0)).eval()
    mixers = [blk.mixer for blk in m.model.layers]
    assert [mx.beta_offset for mx in mixers] == [-3.0, -3.0]
    x = ids(1, 9)
    before = m(x).logits
    m.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert [blk.mixer.beta_offset for blk in loaded.model.layers] == [-3.0, -3.0]
    assert torch.equal(loaded(x).logits, before)
    plain = GDNForCausalLM(GDNConfig.from_preset("gdn", size="tiny", layer_pattern="GD", num_hidden_layers=2)).eval()
    plain.load_state_dict(m.state_dict())
    assert not torch.equal(plain(x).logits, before)  # the offset changes the computation
