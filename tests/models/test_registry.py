"""The mixer table: every layer-pattern letter builds its layer class, keeps the cache state its
entry names, and drives config validation; the exported letter sets come from it."""
from __future__ import annotations

import pytest
import torch

from gdn.layers import KVState, RecurrentState
from gdn.models import (LAYER_TYPES, MIXERS, RECURRENT_LETTERS, GDNCache, GDNConfig, GDNForCausalLM, MixerSpec,
                        build_mixer, mixer, output_cache)
from gdn.models.registry import letters

ALL = "".join(MIXERS)


def config(pattern: str, **kw) -> GDNConfig:
    windowed = any(MIXERS[c].sliding_window for c in pattern)
    return GDNConfig(vocab_size=32, hidden_size=32, num_hidden_layers=len(pattern), layer_pattern=pattern, num_heads=2,
                     head_dim=16, num_attention_heads=2, intermediate_size=64, window_size=4 if windowed else None,
                     **kw)


def test_the_table_holds_every_letter_once_with_consistent_fields():
    assert ALL == "GDMLKAS"
    for letter, spec in MIXERS.items():
        assert isinstance(spec, MixerSpec) and spec.letter == letter and mixer(letter) is spec
        assert spec.state in (RecurrentState, KVState)
        assert spec.recurrent == (spec.state is RecurrentState)
        assert spec.display and spec.name
        assert spec.step_cost is None or spec.step_cost > 0
    assert LAYER_TYPES == {c: s.name for c, s in MIXERS.items()}
    assert RECURRENT_LETTERS == "GDMLK" == letters(lambda s: s.recurrent)
    assert letters(lambda s: s.sliding_window) == "S"


def test_unknown_letter_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown mixer letter 'X'.*G \(gated_deltanet\)"):
        mixer("X")


@torch.no_grad()
def test_every_letter_builds_its_class_and_keeps_its_state_kind():
    cfg = config(ALL)
    model = GDNForCausalLM(cfg).eval()
    for i, c in enumerate(ALL):
        assert type(model.model.layers[i].mixer) is MIXERS[c].layer
        assert type(build_mixer(cfg, i)) is MIXERS[c].layer
    assert cfg.mixer_types == [MIXERS[c].name for c in ALL]
    assert GDNCache.for_config(cfg, 1).is_linear == [MIXERS[c].recurrent for c in ALL]
    cache = output_cache(model(torch.randint(0, 32, (1, 6)), use_cache=True))
    assert [type(s) for s in cache.layers] == [MIXERS[c].state for c in ALL]
    windows = [m.mixer.window_size for m in model.model.layers if isinstance(m.mixer, MIXERS["A"].layer)]
    assert windows == [None, 4]  # A global, S over window_size


def test_options_reach_only_the_letters_that_read_them():
    cfg = config("GDK", beta_offset=-2.0, allow_neg_eigval=True, kda_gate_rank=4)
    g, d, k = (build_mixer(cfg, i) for i in range(3))
    assert g.beta_offset == d.beta_offset == -2.0 and g.allow_neg_eigval and d.allow_neg_eigval
    assert k.gate_low_rank_dim == 4 and not hasattr(k, "beta_offset")
    assert "beta_offset" in MIXERS["G"].options and "kda_gate_rank" in MIXERS["K"].options


def test_validation_follows_the_table():
    with pytest.raises(ValueError, match="kda_gate_rank"):
        config("GK", kda_gate_rank=0)
    config("GA", kda_gate_rank=0)  # read only by K layers: not checked without them
    with pytest.raises(ValueError, match=r"has sliding-window \(S\) layers: set window_size"):
        GDNConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, layer_pattern="GS", num_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="num_key_value_heads"):  # attention fields checked for A
        config("GA", num_key_value_heads=3)
    config("GK", num_key_value_heads=3)  # and not without attention layers
