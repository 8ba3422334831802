"""Models: :class:`GDNConfig` (layer pattern, presets), the mixer table :data:`MIXERS` (one
:class:`MixerSpec` per layer-pattern letter), :class:`GDNModel`, :class:`GDNForCausalLM` and the
decoding cache :class:`GDNCache` (and the fixed-shape
:class:`StaticCache` with its CUDA-graph :class:`GraphDecoder`). Importing this package registers the config and models
with ``transformers``' ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM`` (model type ``gdn``).
"""
from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import GDNCache
from .config import PRESETS, SIZES, GDNConfig
from .modeling import (CACHE_KEY, GDNBlock, GDNForCausalLM, GDNModel, GDNPreTrainedModel, build_mixer,
                       no_weight_decay_names, output_cache, param_groups)
from .registry import LAYER_TYPES, MIXERS, RECURRENT_LETTERS, MixerSpec, mixer
from .static_cache import GraphDecoder, StaticCache, static_decode_step

__all__ = [
    "CACHE_KEY",
    "GDNBlock",
    "GDNCache",
    "GDNConfig",
    "GDNForCausalLM",
    "GDNModel",
    "GDNPreTrainedModel",
    "GraphDecoder",
    "LAYER_TYPES",
    "MIXERS",
    "MixerSpec",
    "PRESETS",
    "RECURRENT_LETTERS",
    "SIZES",
    "StaticCache",
    "build_mixer",
    "mixer",
    "no_weight_decay_names",
    "output_cache",
    "param_groups",
    "register",
    "static_decode_step",
]


def register() -> None:
    """Register ``gdn`` with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM`` (idempotent)."""
    AutoConfig.register(GDNConfig.model_type, GDNConfig, exist_ok=True)
    AutoModel.register(GDNConfig, GDNModel, exist_ok=True)
    AutoModelForCausalLM.register(GDNConfig, GDNForCausalLM, exist_ok=True)


register()
