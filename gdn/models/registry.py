"""The token mixers a layer pattern can name: one :class:`MixerSpec` per letter in :data:`MIXERS`.

Config validation (:class:`gdn.models.GDNConfig`), :func:`gdn.models.build_mixer`, the decoding
cache (:class:`gdn.models.GDNCache`) and ``gdn mqar`` read their letters, layer classes and
properties from this table. Adding a mixer takes its layer file under ``gdn/layers``, one entry
here and its tests.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..layers import Attention, DeltaNet, GatedDeltaNet, GatedLinearAttention, KVState, LinearAttention, RecurrentState
from ..layers.kda import KimiDeltaAttention


@dataclass(frozen=True)
class MixerSpec:
    """One layer-pattern letter.

    Attributes:
        letter: the character in ``layer_pattern``.
        name: the mixer's name (``GDNConfig.mixer_types``).
        layer: the ``nn.Module`` class a layer of this letter is.
        display: a short name for tables and plot legends.
        state: the decoding state a layer keeps in the cache: :class:`gdn.layers.RecurrentState`
            (constant size) or :class:`gdn.layers.KVState` (keys and values).
        builder: ``builder(spec, config, layer_idx)`` -> the layer; call :meth:`build`.
        step_cost: seconds per ``gdn mqar`` training step relative to linear attention, used only
            to start the longest runs first; None for a mixer ``gdn mqar`` does not run.
        options: the ``GDNConfig`` fields this mixer reads beyond those its family shares (the
            recurrent fields, or the attention fields).
        sliding_window: the layer attends over ``GDNConfig.window_size`` tokens (the config needs
            a window exactly when the pattern has such a letter).
    """

    letter: str
    name: str
    layer: type[nn.Module]
    display: str
    state: type
    builder: Callable[["MixerSpec", object, int], nn.Module]
    step_cost: float | None
    options: tuple[str, ...] = ()
    sliding_window: bool = False

    @property
    def recurrent(self) -> bool:
        """True when the layer keeps a constant-size state rather than its tokens' keys and values."""
        return self.state is RecurrentState

    def build(self, config, layer_idx: int) -> nn.Module:
        """The layer ``layer_idx`` of a model with :class:`gdn.models.GDNConfig` ``config``."""
        return self.builder(self, config, layer_idx)


def _recurrent_family(config, layer_idx: int) -> dict:
    """Keyword arguments every recurrent mixer takes from the config."""
    return dict(num_v_heads=config.num_v_heads, expand_v=config.expand_v, use_short_conv=config.use_short_conv,
                conv_size=config.conv_size, norm_eps=config.norm_eps, layer_idx=layer_idx)


def _build_recurrent(spec: MixerSpec, config, layer_idx: int) -> nn.Module:
    """A :class:`gdn.layers.recurrent.RecurrentMixer` with an output gate; its options are passed under
    their config names."""
    kw = _recurrent_family(config, layer_idx)
    kw.update(use_gate=config.use_gate, **{name: getattr(config, name) for name in spec.options})
    return spec.layer(config.hidden_size, config.num_heads, config.head_dim, **kw)


def _build_kda(spec: MixerSpec, config, layer_idx: int) -> nn.Module:
    """Kimi Delta Attention: its own low-rank output gate, of rank ``kda_gate_rank``."""
    return spec.layer(config.hidden_size, config.num_heads, config.head_dim, gate_low_rank_dim=config.kda_gate_rank,
                      **_recurrent_family(config, layer_idx))


def _build_attention(spec: MixerSpec, config, layer_idx: int) -> nn.Module:
    """Softmax attention, over ``window_size`` tokens for a sliding-window letter."""
    return spec.layer(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                      config.resolved_attention_head_dim,
                      window_size=config.window_size if spec.sliding_window else None, rope_theta=config.rope_theta,
                      layer_idx=layer_idx, output_gate=config.attention_output_gate, qk_norm=config.attention_qk_norm,
                      partial_rotary_factor=config.partial_rotary_factor, norm_eps=config.norm_eps)


#: The options of the delta-rule layers with a scalar β (D, G).
_DELTA_OPTIONS = ("allow_neg_eigval", "beta_offset")

# Step costs: the runs' times in a cpu-small MQAR grid (width 32, one head, seed 0), one thread per run
# on 2 cores. K: a training step of the same model takes 3.1 times G's, so 3.1 x 1.3.

#: Every mixer, by layer-pattern letter, in the order error messages and tables list them.
MIXERS: dict[str, MixerSpec] = {s.letter: s for s in (
    MixerSpec("G", "gated_deltanet", GatedDeltaNet, "Gated DeltaNet", RecurrentState, _build_recurrent,
              step_cost=1.3, options=_DELTA_OPTIONS),
    MixerSpec("D", "deltanet", DeltaNet, "DeltaNet", RecurrentState, _build_recurrent,
              step_cost=1.2, options=_DELTA_OPTIONS),
    MixerSpec("M", "gated_linear_attention", GatedLinearAttention, "gated linear attn", RecurrentState,
              _build_recurrent, step_cost=1.1),
    MixerSpec("L", "linear_attention", LinearAttention, "linear attention", RecurrentState, _build_recurrent,
              step_cost=1.0),
    MixerSpec("K", "kimi_delta_attention", KimiDeltaAttention, "Kimi Delta Attn", RecurrentState, _build_kda,
              step_cost=4.0, options=("kda_gate_rank",)),
    MixerSpec("A", "attention", Attention, "softmax attention", KVState, _build_attention, step_cost=0.5),
    MixerSpec("S", "sliding_window_attention", Attention, "sliding-window attn", KVState, _build_attention,
              step_cost=None, sliding_window=True),
)}


def mixer(letter: str) -> MixerSpec:
    """The :class:`MixerSpec` of a layer-pattern letter; ``ValueError`` listing the letters otherwise."""
    try:
        return MIXERS[letter]
    except (KeyError, TypeError):
        raise ValueError(f"unknown mixer letter {letter!r}; use one of "
                         + ", ".join(f"{s.letter} ({s.name})" for s in MIXERS.values())) from None


def letters(predicate: Callable[[MixerSpec], bool] = lambda s: True) -> str:
    """The letters whose spec satisfies ``predicate``, in table order (all of them by default)."""
    return "".join(s.letter for s in MIXERS.values() if predicate(s))


#: Token mixer name of each letter.
LAYER_TYPES: dict[str, str] = {s.letter: s.name for s in MIXERS.values()}

#: Letters of the recurrent mixers (constant-size state); the others keep keys and values.
RECURRENT_LETTERS: str = letters(lambda s: s.recurrent)
