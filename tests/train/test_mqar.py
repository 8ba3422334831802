"""``beta_offset`` (the β-initialisation option ``gdn mqar`` turns on) and the MQAR recipe plumbing.

The option must leave the published layers unchanged by default, add exactly ``beta_offset`` to
the β pre-activation when set, keep the state dict (Qwen-compatible weights) unchanged, be
validated, and survive a config save/load.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gdn import ops
from gdn.layers import DeltaNet, GatedDeltaNet
from gdn.ops.gates import l2_normalise, scalar_decay
from gdn.models import GDNConfig

D = 32


def make(cls, **kw):
    torch.manual_seed(0)
    return cls(D, 2, 16, num_v_heads=2, expand_v=1.0, use_short_conv=False, use_gate=False, **kw).eval()


def by_hand(m, x, offset):
    """The layer's recurrence with β = sigmoid(b_proj x + offset), written out (no short conv, no gate)."""
    B, T, _ = x.shape
    q = torch.nn.functional.silu(m.q_proj(x)).view(B, T, 2, 16)
    k = torch.nn.functional.silu(m.k_proj(x)).view(B, T, 2, 16)
    v = torch.nn.functional.silu(m.v_proj(x)).view(B, T, 2, 16)
    beta = torch.sigmoid(m.b_proj(x).float() + offset)
    if isinstance(m, GatedDeltaNet):
        g = scalar_decay(m.a_proj(x), m.A_log, m.dt_bias)
        o, _ = ops.gated_delta_rule(l2_normalise(q), l2_normalise(k), v, g, beta)
    else:
        o, _ = ops.delta_rule(l2_normalise(q), l2_normalise(k), v, beta)
    return m.o_proj(m.o_norm(o).reshape(B, T, 32))


@pytest.mark.parametrize("cls", [DeltaNet, GatedDeltaNet])
@pytest.mark.parametrize("offset", [0.0, 3.0, -1.5])
def test_beta_offset_shifts_the_beta_preactivation(cls, offset):
    m = make(cls, beta_offset=offset)
    x = torch.randn(2, 20, D)
    with torch.no_grad():
        out, _ = m(x)
        ref = by_hand(m, x, offset)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls", [DeltaNet, GatedDeltaNet])
def test_beta_offset_default_is_the_published_layer_and_keeps_the_state_dict(cls):
    plain, shifted = make(cls), make(cls, beta_offset=3.0)
    assert plain.beta_offset == 0.0
    sd_plain, sd_shift = plain.state_dict(), shifted.state_dict()
    assert sd_plain.keys() == sd_shift.keys()
    assert all(torch.equal(sd_plain[k], sd_shift[k]) for k in sd_plain)
    x = torch.randn(1, 12, D)
    with torch.no_grad():
        assert not torch.allclose(plain(x)[0], shifted(x)[0], atol=1e-4)  # the offset does change β


@pytest.mark.parametrize("cls", [DeltaNet, GatedDeltaNet])
@pytest.mark.parametrize("bad", ["3", True, math.nan, math.inf, None])
def test_beta_offset_rejects_non_finite_numbers(cls, bad):
    with pytest.raises(ValueError, match="beta_offset"):
        make(cls, beta_offset=bad)


@pytest.mark.parametrize("bad", ["3", True, math.inf])
def test_config_rejects_bad_beta_offset(bad):
    with pytest.raises(ValueError, match="beta_offset"):
        GDNConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, layer_pattern="GD", num_heads=2, head_dim=16,
                  beta_offset=bad)


def test_config_beta_offset_saves_and_loads(tmp_path):
    cfg = GDNConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, layer_pattern="GD", num_heads=2, head_dim=16,
                    beta_offset=2.5)
    cfg.save_pretrained(tmp_path)
    assert GDNConfig.from_pretrained(tmp_path).beta_offset == 2.5
    assert GDNConfig(vocab_size=16, hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=16).beta_offset == 0.0


def test_mqar_model_applies_the_recipe():
    from gdn.layers import GatedLinearAttention, LinearAttention
    from gdn.train.mqar import MQARConfig, build_model

    cfg = MQARConfig(widths=[16], num_pairs=[2], seq_len=16, vocab_size=16, beta_offset=-3.0,
                     decay_init=[0.5, 1.0, 1e-3, 1e-2])
    for letter, cls in (("D", DeltaNet), ("G", GatedDeltaNet), ("M", GatedLinearAttention), ("L", LinearAttention)):
        model = build_model(letter, 16, cfg)
        mixers = [b.mixer for b in model.model.layers]
        assert all(type(m) is cls for m in mixers)
        if letter in "DG":
            assert model.config.beta_offset == -3.0 and all(m.beta_offset == -3.0 for m in mixers)
        else:
            assert model.config.beta_offset == 0.0
        for m in mixers:
            if letter in "MG":  # A = exp(A_log) in [0.5, 1]; dt = softplus(dt_bias) in [1e-3, 1e-2]
                A, dt = m.A_log.exp(), torch.nn.functional.softplus(m.dt_bias)
                assert ((A >= 0.5 - 1e-6) & (A <= 1 + 1e-6)).all()
                assert ((dt >= 1e-3 * 0.999) & (dt <= 1e-2 * 1.001)).all()
            else:
                assert not hasattr(m, "A_log")


def test_mqar_model_without_the_recipe_keeps_the_layers_defaults():
    from gdn.train.mqar import MQARConfig, build_model

    cfg = MQARConfig(widths=[16], num_pairs=[2], seq_len=16, vocab_size=16)
    torch.manual_seed(0)
    model = build_model("G", 16, cfg)
    assert all(b.mixer.beta_offset == 0.0 for b in model.model.layers)
    A = torch.cat([b.mixer.A_log.exp() for b in model.model.layers])
    assert ((A >= 0.01 - 1e-6) & (A <= 16 + 1e-4)).all()


@pytest.mark.parametrize("key,bad", [("beta_offset", "x"), ("beta_offset", math.nan), ("decay_init", [1, 2, 3]),
                                     ("decay_init", [2.0, 1.0, 1e-3, 1e-2]), ("decay_init", [0.5, 1.0, 0.0, 1e-2]),
                                     ("decay_init", "fast")])
def test_mqar_config_rejects_bad_recipe_values(key, bad):
    from gdn.train.mqar import MQARConfig

    with pytest.raises(ValueError, match=key):
        MQARConfig(**{key: bad})


def test_mqar_schedule_is_the_shared_lr_factor_warmup_constant_then_cosine():
    from gdn.train.loop import lr_factor
    from gdn.train.mqar import schedule_steps

    steps, warm = 200, 10

    def mqar_factor(s, steps, warmup_frac, decay_frac):
        warmup, decay = schedule_steps(steps, warmup_frac, decay_frac)
        return lr_factor(s, warmup, steps, 0.0, decay)

    f = [mqar_factor(s, steps, 0.05, 0.25) for s in range(steps)]
    assert f[0] == pytest.approx(1 / warm) and f[warm - 1] == pytest.approx(1.0)
    assert all(v == 1.0 for v in f[warm:150])  # constant until the last 25 % of the steps
    assert all(a > b for a, b in zip(f[151:], f[152:])) and f[-1] < 1e-3
    full = [mqar_factor(s, steps, 0.05, 1.0) for s in range(steps)]  # decay_frac=1: warmup, then cosine at once
    assert full[warm] == pytest.approx(1.0) and full[warm + 1] < 1.0
    assert full[105] == pytest.approx(0.5 * (1 + math.cos(math.pi * 95 / 190)))


@pytest.mark.parametrize("key,bad", [("warmup_frac", 1.5), ("decay_frac", -0.1), ("decay_frac", "all")])
def test_mqar_config_rejects_bad_schedule(key, bad):
    from gdn.train.mqar import MQARConfig

    with pytest.raises(ValueError, match=key):
        MQARConfig(**{key: bad})


@pytest.mark.parametrize("preset", ["cpu-small", "paper"])
def test_presets_turn_the_recipe_on_and_the_defaults_leave_it_off(preset):
    from gdn.train.mqar import MQARConfig, mqar_config

    cfg = mqar_config(preset)
    assert cfg.beta_offset == -3.0 and list(cfg.decay_init) == [0.01, 1.0, 1e-3, 1e-2]
    assert MQARConfig().beta_offset == 0.0 and MQARConfig().decay_init is None
    assert mqar_config(preset, sets=["beta_offset=0", "decay_init=null"]).decay_init is None


def test_mqar_mixture_holds_every_pair_count_in_equal_shares():
    from gdn.data.mqar import mqar_mixture

    x, y = mqar_mixture(31, 64, [4, 8, 16], 128, seed=3)
    assert x.shape == y.shape == (31, 64)
    counts = (y != -100).sum(1).tolist()
    assert sorted(set(counts)) == [4, 8, 16]
    assert [counts.count(p) for p in (4, 8, 16)] == [11, 10, 10]  # 31 = 11 + 10 + 10, first share one more
    assert counts[:11] != [4] * 11  # shuffled, not in blocks
    for n in range(31):  # every sequence is a valid MQAR sequence: each query asks a key of its own context
        p = counts[n]
        pair = dict(zip(x[n, 0 : 2 * p : 2].tolist(), x[n, 1 : 2 * p : 2].tolist()))
        q = (y[n] != -100).nonzero().flatten()
        assert all(pair[int(x[n, t])] == int(y[n, t]) for t in q.tolist())
    x2, _ = mqar_mixture(31, 64, [4, 8, 16], 128, seed=3)
    assert torch.equal(x, x2) and not torch.equal(x, mqar_mixture(31, 64, [4, 8, 16], 128, seed=4)[0])
    with pytest.raises(ValueError, match="pairs"):
        mqar_mixture(8, 64, [], 128)
    with pytest.raises(ValueError, match="num_examples"):
        mqar_mixture(2, 64, [4, 8, 16], 128)
    with pytest.raises(ValueError, match="seq_len"):
        mqar_mixture(8, 32, [4, 16], 128)


@pytest.mark.parametrize("bad", [[], [0], "16", [4, True], [40]])
def test_mqar_config_rejects_bad_train_pairs(bad):
    from gdn.train.mqar import MQARConfig

    with pytest.raises(ValueError, match="train_pairs"):
        MQARConfig(train_pairs=bad)


def _result(m, w, acc, lr=1e-3, p=16):
    return dict(mixer=m, width=w, num_pairs=p, lr=lr, accuracy=acc, final_loss=0.0, seconds=1.0)


def test_delta_rule_ahead_compares_the_best_learning_rate_per_column():
    from gdn.train.mqar import delta_rule_ahead, format_table

    rs = [_result("L", 32, 0.80), _result("L", 32, 0.85, lr=3e-3), _result("D", 32, 0.84),
          _result("D", 32, 0.90, lr=3e-3), _result("G", 32, 0.86), _result("A", 32, 0.99),
          _result("L", 64, 0.95), _result("D", 64, 0.97), _result("G", 64, 0.95)]  # G ties L at 64: not ahead
    assert delta_rule_ahead(rs) == {(32, 16): True, (64, 16): False}
    table = format_table(rs)
    assert "| DeltaNet (D) | 0.900 | 0.970 |" in table
    assert table.splitlines()[-1] == ("delta rule (D, G) ahead of linear attention (L): "
                                      "d=32, 16 kv: yes, d=64, 16 kv: NO")
    assert delta_rule_ahead([_result("D", 32, 0.9), _result("A", 32, 0.5)]) == {}  # no L: nothing to say
    assert "ahead" not in format_table([_result("D", 32, 0.9)])


def test_run_mqar_starts_the_longest_runs_first_and_reports_in_grid_order(tmp_path, monkeypatch):
    from gdn.train import mqar

    calls = []

    def fake(cfg, letter, width, pairs, lr):
        calls.append(letter)
        return _result(letter, width, 0.5, lr=lr, p=pairs)

    monkeypatch.setattr(mqar, "train_one", fake)
    monkeypatch.setattr(mqar, "plot", lambda results, png: png)
    cfg = mqar.MQARConfig(mixers="LADG", widths=[16], num_pairs=[2], lrs=[1e-3], seq_len=16, vocab_size=16,
                          workers=1, out=str(tmp_path))
    results = mqar.run_mqar(cfg)
    assert calls == sorted("LADG", key=lambda m: -mqar.STEP_COST[m])  # G, D (delta rule) before L, A
    assert [r["mixer"] for r in results] == list("LADG")
    assert "delta rule (D, G) ahead" in (tmp_path / "table.md").read_text()


def test_cpu_small_preset_builds_every_mixer_with_one_head_of_the_full_width():
    """cpu-small's models: one head per layer (head size = width), so each mixer's state is a single
    32 x 32 matrix; every letter builds and maps a preset batch to logits over the 512 ids."""
    from gdn.data import mqar_batch
    from gdn.train.mqar import build_model, mqar_config

    cfg = mqar_config("cpu-small")
    (width,), (pairs,) = cfg.widths, cfg.num_pairs
    assert (cfg.num_heads, width, pairs, cfg.vocab_size, cfg.seq_len) == (1, 32, 16, 512, 64)
    assert cfg.epochs * cfg.train_examples // cfg.batch_size == 2000  # steps, each on fresh sequences
    x, y = mqar_batch(2, cfg.seq_len, pairs, cfg.vocab_size, seed=0)
    assert int((y != -100).sum()) == 2 * pairs
    for letter in cfg.mixers:
        torch.manual_seed(0)
        model = build_model(letter, width, cfg).eval()
        c = model.config
        assert (c.num_heads, c.head_dim, c.num_attention_heads) == (1, 32, 1)
        with torch.no_grad():
            logits = model(input_ids=x, use_cache=False).logits
        assert logits.shape == (2, cfg.seq_len, cfg.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("letter", list("GDMLKA"))
def test_mqar_builds_and_trains_every_recurrent_mixer_and_attention(letter):
    """Every recurrent letter and global attention runs through ``train_one``: a model is built and
    trained two steps, and its cell reports an accuracy and a finite loss."""
    from gdn.train.mqar import MQARConfig, build_model, train_one

    cfg = MQARConfig(mixers=letter, widths=[16], num_pairs=[2], lrs=[1e-3], seq_len=16, vocab_size=16,
                     train_examples=8, test_examples=4, epochs=1, batch_size=4, device="cpu", workers=1)
    assert build_model(letter, 16, cfg).config.layer_pattern == letter * 2
    r = train_one(cfg, letter, 16, 2, 1e-3)
    assert (r["mixer"], r["width"], r["num_pairs"], r["lr"]) == (letter, 16, 2, 1e-3)
    assert 0.0 <= r["accuracy"] <= 1.0 and math.isfinite(r["final_loss"])


def test_mqar_letters_step_costs_and_names_come_from_the_mixer_table():
    from gdn.models import MIXERS, RECURRENT_LETTERS
    from gdn.train import mqar

    assert mqar.LETTERS == RECURRENT_LETTERS + "A"
    assert mqar.STEP_COST == {c: MIXERS[c].step_cost for c in mqar.LETTERS}
    assert mqar.MIXER_NAMES["K"] == MIXERS["K"].display
    assert mqar.MQARConfig(mixers=mqar.LETTERS).mixers == mqar.LETTERS
    with pytest.raises(ValueError, match="mixers"):
        mqar.MQARConfig(mixers="GS")  # sliding-window attention: MQAR's config sets no window


def test_cpu_small_config_file_is_the_preset():
    """configs/mqar-cpu-small.yaml spells out the cpu-small preset: loading it changes no setting."""
    from pathlib import Path

    from gdn.train.mqar import mqar_config

    path = Path(__file__).resolve().parents[2] / "configs" / "mqar-cpu-small.yaml"
    preset = dataclasses.asdict(mqar_config("cpu-small"))
    from_file = dataclasses.asdict(mqar_config("cpu-small", file=str(path)))
    assert {k: v for k, v in from_file.items() if k != "out"} == {k: v for k, v in preset.items() if k != "out"}
    bare = dataclasses.asdict(mqar_config("paper", file=str(path)))
    assert {k: v for k, v in bare.items() if k not in ("out", "workers")} == \
        {k: v for k, v in preset.items() if k not in ("out", "workers")}


def test_verdict_only_when_both_delta_rule_mixers_and_the_baseline_ran():
    from gdn.train.mqar import delta_rule_ahead, format_table

    def row(m, acc):
        return {"mixer": m, "width": 32, "num_pairs": 8, "lr": 1e-3, "accuracy": acc}

    both = [row("L", 0.2), row("D", 0.9), row("G", 0.8)]
    assert delta_rule_ahead(both) == {(32, 8): True} and "ahead of linear attention" in format_table(both)
    for missing in ("D", "G", "L"):
        part = [r for r in both if r["mixer"] != missing]
        assert delta_rule_ahead(part) == {}, missing
        assert "ahead" not in format_table(part), missing
