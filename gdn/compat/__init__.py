"""Interoperability with the models and code people already run.

- :mod:`gdn.compat.fla`: FLA-compatible ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``
  / ``chunk_kda`` / ``fused_recurrent_kda`` on gdn's backends, and :func:`gdn.compat.fla.patch_transformers`,
  the one-line switch that makes transformers' Qwen3-Next / Qwen3.5 / Kimi Linear layers use them.
- :mod:`gdn.compat.convert`: Qwen3.5 / Qwen3-Next checkpoints to gdn models and back
  (``gdn convert hf-qwen3.5 SRC DST``).
  Their gated full attention (q/k norm, partial rotary, sigmoid output gate) is an option of
  :class:`gdn.layers.Attention`, so converted folders load with ``from_pretrained``.

Submodules are imported on use (``import gdn.compat.fla``), so importing this package is cheap.
"""
