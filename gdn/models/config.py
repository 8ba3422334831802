"""Model configuration: width, depth, a layer pattern of token mixers, and named presets."""
from __future__ import annotations

import difflib
import inspect
import math

from transformers import PretrainedConfig

from .registry import LAYER_TYPES, MIXERS, letters

#: Width, depth and head layout of each size (vocabulary 32000, the paper's Llama-2 tokenizer, except tiny).
SIZES: dict[str, dict] = {
    "tiny": dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_heads=2, head_dim=32, expand_v=2.0,
                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=352, window_size=64,
                 max_position_embeddings=2048),
    "125m": dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_heads=4, head_dim=128, expand_v=2.0,
                 num_attention_heads=12, num_key_value_heads=12, intermediate_size=2048, window_size=2048,
                 max_position_embeddings=4096),
    "340m": dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=24, num_heads=6, head_dim=128, expand_v=2.0,
                 num_attention_heads=16, num_key_value_heads=16, intermediate_size=2816, window_size=2048,
                 max_position_embeddings=4096),
    "1.3b": dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=24, num_heads=6, head_dim=256, expand_v=2.0,
                 num_attention_heads=16, num_key_value_heads=16, intermediate_size=5632, window_size=2048,
                 max_position_embeddings=4096),
}


def _deltanet_transformer(n: int) -> str:
    """D and S interleaved (D at odd layers, counting from 1), global attention at layers 2 and n/2 + 1."""
    pattern = ["D" if i % 2 == 0 else "S" for i in range(n)]
    for layer in {2, n // 2 + 1}:
        if layer <= n:
            pattern[layer - 1] = "A"
    return "".join(pattern)


def _repeat(unit: str):
    return lambda n: (unit * (n // len(unit) + 1))[:n]


#: Layer pattern of each preset, as a function of the number of layers.
PRESETS = {
    "gdn": _repeat("G"),
    "gdn-h1": _repeat("GS"),
    "gdn-h2": _repeat("MGS"),
    "deltanet-transformer": _deltanet_transformer,
    "qwen3next": _repeat("GGGA"),
    "transformer": _repeat("A"),
}


def _check_positive(name: str, val) -> None:
    if isinstance(val, bool) or not isinstance(val, int) or val < 1:
        raise ValueError(f"{name} must be a positive int, got {val!r}")


def did_you_mean(unknown, valid, synonyms: dict | None = None) -> str:
    """The hint ``" (did you mean a, b?)"`` of an unknown-keys error: for each of the ``unknown``
    keys its ``synonyms`` entry where that is ``valid``, else the closest valid spelling ("" where
    there is none)."""
    close = []
    for k in map(str, unknown):
        alias = (synonyms or {}).get(k)
        close += [alias] if alias in valid else difflib.get_close_matches(k, valid, n=1)
    return f" (did you mean {', '.join(close)}?)" if close else ""


class GDNConfig(PretrainedConfig):
    """Configuration of :class:`gdn.models.GDNForCausalLM`.

    The stack is ``num_hidden_layers`` pre-norm blocks (mixer + SwiGLU); ``layer_pattern`` has one
    letter per layer: ``G`` Gated DeltaNet, ``D`` DeltaNet, ``M`` gated linear attention (Mamba2
    decay), ``L`` linear attention, ``K`` Kimi Delta Attention (per-channel decay), ``A`` global
    softmax attention, ``S`` sliding-window attention (:data:`gdn.models.registry.MIXERS`).

    Args:
        vocab_size, hidden_size (D), num_hidden_layers (N), layer_pattern (str of length N).
        num_heads, head_dim, num_v_heads, expand_v: recurrent mixers' q/k heads H, key size K,
            value heads HV (default H, a multiple of H) and value size K·expand_v.
        use_short_conv, conv_size, use_gate, allow_neg_eigval: recurrent mixer options.
        beta_offset: constant added to the β pre-activation of ``G`` and ``D`` layers (β starts near
            sigmoid(beta_offset) instead of 0.5; no parameter, checkpoints unchanged). Default 0, the
            published layers and Qwen3-Next / Qwen3.5; ``gdn mqar``'s presets turn it on.
        kda_gate_rank: rank of the low-rank gate projections of ``K`` layers (default head_dim).
        num_attention_heads, num_key_value_heads, attention_head_dim (default D / heads),
            window_size (needed by, and only allowed with, ``S`` layers), rope_theta: attention.
        attention_output_gate, attention_qk_norm, partial_rotary_factor: the options of Qwen3-Next /
            Qwen3.5's gated attention for ``A`` / ``S`` layers (a sigmoid output gate, an RMSNorm on
            every query and key head, RoPE on the leading fraction of each head); see
            :class:`gdn.layers.Attention`. Defaults: plain attention.
        intermediate_size: SwiGLU inner width (default 8/3·D rounded up to a multiple of 256).
        norm_eps, initializer_range (std of the normal init), tie_word_embeddings.
        max_position_embeddings: the context the model is meant for (informational; RoPE has no limit).

    Invalid combinations raise ``ValueError`` at construction, saying what to change.
    """

    model_type = "gdn"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 1024, num_hidden_layers: int = 24,
                 layer_pattern: str | None = None, num_heads: int = 6, head_dim: int = 128,
                 num_v_heads: int | None = None, expand_v: float = 2.0, use_short_conv: bool = True,
                 conv_size: int = 4, use_gate: bool = True, allow_neg_eigval: bool = False,
                 kda_gate_rank: int | None = None,
                 num_attention_heads: int = 16, num_key_value_heads: int | None = None,
                 attention_head_dim: int | None = None, window_size: int | None = None, rope_theta: float = 10000.0,
                 intermediate_size: int | None = None, norm_eps: float = 1e-6, initializer_range: float = 0.02,
                 tie_word_embeddings: bool = False, max_position_embeddings: int = 4096, use_cache: bool = True,
                 attention_output_gate: bool = False, attention_qk_norm: bool = False,
                 partial_rotary_factor: float = 1.0, beta_offset: float = 0.0, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.layer_pattern = "G" * num_hidden_layers if layer_pattern is None else layer_pattern
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_v_heads = num_heads if num_v_heads is None else num_v_heads
        self.expand_v = expand_v
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.use_gate = use_gate
        self.allow_neg_eigval = allow_neg_eigval
        self.beta_offset = beta_offset
        self.kda_gate_rank = kda_gate_rank
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.attention_head_dim = attention_head_dim
        self.window_size = window_size
        self.rope_theta = rope_theta
        self.attention_output_gate = attention_output_gate
        self.attention_qk_norm = attention_qk_norm
        self.partial_rotary_factor = partial_rotary_factor
        if intermediate_size is None and isinstance(hidden_size, int):
            intermediate_size = -(-(8 * hidden_size // 3) // 256) * 256
        self.intermediate_size = intermediate_size
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        self._validate()
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "num_v_heads",
                     "conv_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                     "max_position_embeddings"):
            _check_positive(name, getattr(self, name))
        pat = self.layer_pattern
        if not isinstance(pat, str):
            raise ValueError(f"layer_pattern must be a string of letters {''.join(LAYER_TYPES)}, got {pat!r}")
        bad = sorted({c for c in pat if c not in LAYER_TYPES})
        if bad:
            raise ValueError(f"layer_pattern {pat!r} has unknown letters {bad}; use only "
                             + ", ".join(f"{k} ({v})" for k, v in LAYER_TYPES.items()))
        if len(pat) != self.num_hidden_layers:
            raise ValueError(f"layer_pattern has {len(pat)} letters but num_hidden_layers is {self.num_hidden_layers}; "
                             "give one letter per layer")
        specs = [MIXERS[c] for c in dict.fromkeys(pat)]
        if any(s.recurrent for s in specs):
            if self.num_v_heads % self.num_heads != 0:
                raise ValueError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_heads ({self.num_heads})")
            if self.kda_gate_rank is not None and any("kda_gate_rank" in s.options for s in specs):
                _check_positive("kda_gate_rank", self.kda_gate_rank)
            v = self.head_dim * self.expand_v
            if not isinstance(self.expand_v, (int, float)) or self.expand_v <= 0 or v != int(v):
                raise ValueError(f"head_dim * expand_v must be a positive integer, got {self.head_dim} * {self.expand_v!r}")
        b = self.beta_offset
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise ValueError(f"beta_offset must be a finite number, got {b!r}")
        for name in ("attention_output_gate", "attention_qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {f!r}")
        if any(not s.recurrent for s in specs):
            if self.num_attention_heads % self.num_key_value_heads != 0:
                raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                                 f"num_key_value_heads ({self.num_key_value_heads})")
            if self.attention_head_dim is None:
                if self.hidden_size % self.num_attention_heads != 0:
                    raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                                     f"({self.num_attention_heads}), or set attention_head_dim")
                hd = self.hidden_size // self.num_attention_heads
            else:
                _check_positive("attention_head_dim", self.attention_head_dim)
                hd = self.attention_head_dim
            rot = int(hd * self.partial_rotary_factor)
            if rot < 2 or rot % 2:
                raise ValueError(f"the attention head size times partial_rotary_factor ({hd} * "
                                 f"{self.partial_rotary_factor} = {rot} channels) must be even and >= 2 for RoPE; "
                                 "change num_attention_heads, attention_head_dim or partial_rotary_factor")
        windowed = letters(lambda s: s.sliding_window)
        if any(s.sliding_window for s in specs):
            if self.window_size is None:
                raise ValueError(f"layer_pattern {pat!r} has sliding-window ({windowed}) layers: set window_size")
            _check_positive("window_size", self.window_size)
        elif self.window_size is not None:
            raise ValueError(f"window_size={self.window_size} is set but layer_pattern {pat!r} has no {windowed} "
                             f"layers: set window_size=None or use {windowed} layers")

    @property
    def mixer_types(self) -> list[str]:
        """The mixer name of every layer, from ``layer_pattern``."""
        return [LAYER_TYPES[c] for c in self.layer_pattern]

    @property
    def resolved_attention_head_dim(self) -> int:
        """Attention head size: ``attention_head_dim`` or hidden_size / num_attention_heads."""
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """Does nothing, as :meth:`gdn.models.GDNPreTrainedModel.register_for_auto_class`."""

    @classmethod
    def field_names(cls) -> list[str]:
        """The fields a user may set, sorted: the constructor's named arguments."""
        params = inspect.signature(cls.__init__).parameters
        return sorted(n for n, p in params.items() if n != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD)

    @classmethod
    def check_overrides(cls, overrides) -> None:
        """Raise ValueError for keys of ``overrides`` that are none of :meth:`field_names` (a typo
        would otherwise become an attribute nothing reads), naming the closest valid key and listing
        them all. Only what a user writes is checked: a saved ``config.json`` with the fields of a
        newer version still loads."""
        valid = cls.field_names()
        unknown = sorted(str(k) for k in overrides if k not in valid)
        if not unknown:
            return
        raise ValueError(f"unknown model keys {unknown}{did_you_mean(unknown, valid)}; valid keys: {valid}")

    def differences(self, other: "GDNConfig") -> list[str]:
        """``["hidden_size 32 -> 64", "layer_pattern 'GG' -> 'GS'"]``: the :meth:`field_names` whose
        values differ from this config's to ``other``'s (``use_cache``, a runtime switch, aside)."""
        out = []
        for name in self.field_names():
            a, b = getattr(self, name, None), getattr(other, name, None)
            if name != "use_cache" and a != b:
                out.append(f"{name} {a!r} -> {b!r}")
        return out

    @classmethod
    def from_preset(cls, name: str, size: str = "tiny", **overrides) -> "GDNConfig":
        """A named architecture at a named size.

        Args:
            name: ``gdn`` (all G), ``gdn-h1`` (G, S alternating), ``gdn-h2`` (M, G, S repeating),
                ``deltanet-transformer`` (D, S interleaved; A at layers 2 and N/2 + 1), ``qwen3next``
                (G, G, G, A repeating), ``transformer`` (all A).
            size: ``tiny``, ``125m``, ``340m`` or ``1.3b``.
            overrides: any constructor argument (others raise ValueError listing the valid ones); the
                pattern follows an overridden ``num_hidden_layers`` unless ``layer_pattern`` is given too.
        """
        cls.check_overrides(overrides)
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; choose one of {list(SIZES)}")
        kw = dict(SIZES[size])
        kw.update(overrides)
        kw.setdefault("layer_pattern", PRESETS[name](kw["num_hidden_layers"]))
        windowed = any(MIXERS[c].sliding_window for c in kw["layer_pattern"] if c in MIXERS)
        if not windowed and "window_size" not in overrides:
            kw["window_size"] = None
        return cls(**kw)
