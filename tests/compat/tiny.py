"""Tiny random configs of the transformers models gdn interoperates with (fast on a CPU)."""
from __future__ import annotations

import torch


def qwen3_5_config(**over):
    """Qwen3.5 text: 4 layers (3 gated-delta, 1 gated full attention), grouped value heads, partial rotary."""
    from transformers import Qwen3_5TextConfig

    kw = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
              linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
              layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(over)
    return Qwen3_5TextConfig(**kw)


def qwen3_next_config(**over):
    """Qwen3-Next with dense MLPs (num_experts = 0): the same mixers, fused qkvz/ba projections."""
    from transformers import Qwen3NextConfig

    kw = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
              linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=0,
              layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(over)
    return Qwen3NextConfig(**kw)


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> torch.nn.Module:
    """Give every parameter random values (norm weights and gate parameters included), so a
    wrong mapping of any tensor changes the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (std if p.dim() > 1 else 0.3))
    return model


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error ‖x − ref‖ / ‖ref‖ (inf for non-finite x)."""
    x, ref = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm())
