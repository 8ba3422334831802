"""The gated full-attention layer of Qwen3-Next / Qwen3.5, in gdn's layer contract.

Qwen's full-attention layers differ from :class:`gdn.layers.Attention` in three ways:

- an RMSNorm over the head dim on queries and keys (before RoPE);
- partial rotary: RoPE on the first ``rotary_dim`` channels of each head only (Qwen uses 1/4);
- an output gate: ``o ← o ⊙ sigmoid(g_proj x)`` per channel, before ``o_proj``.

:class:`GatedAttention` adds them and keeps everything else (grouped heads, sliding window,
KV state, padding and packing) from :class:`gdn.layers.Attention`. :func:`attention_options`
reads them from a :class:`gdn.models.GDNConfig`; :func:`apply_attention_options` swaps them into a
built model (a no-op for models whose config asks for plain attention).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..layers import Attention, RMSNorm, rotary
from ..layers.conv import _seq_position
from ..layers.state import KVState

#: Config attributes (extra keys of a GDNConfig) that select the gated attention, and their plain values.
OPTION_DEFAULTS = {"attention_output_gate": False, "attention_qk_norm": False, "partial_rotary_factor": 1.0}


def partial_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    """RoPE on the first ``rotary_dim`` channels of each head, the rest passed through.

    x: [B, T, H, D]; positions: [B, T] or [T]. Returns [B, T, H, D] in x.dtype."""
    if rotary_dim == x.shape[-1]:
        return rotary(x, positions, theta)
    return torch.cat([rotary(x[..., :rotary_dim], positions, theta), x[..., rotary_dim:]], dim=-1)


class GatedAttention(Attention):
    """Softmax attention with q/k RMSNorm, partial rotary and a sigmoid output gate (Qwen3-Next / Qwen3.5).

    Args: those of :class:`gdn.layers.Attention`, plus
        output_gate: multiply the attention output by ``sigmoid(g_proj x)`` [B, T, HQ·D] before ``o_proj``.
        qk_norm: RMSNorm (eps ``norm_eps``) over each query and key head before RoPE.
        partial_rotary_factor: fraction of each head's channels that RoPE rotates (an even count).
        norm_eps: epsilon of the q/k norms.

    Forward as :class:`gdn.layers.Attention`: ``x`` [B, T, D] -> ``(o [B, T, D], KVState or None)``.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 window_size: int | None = None, rope_theta: float = 10000.0, layer_idx: int | None = None, *,
                 output_gate: bool = True, qk_norm: bool = True, partial_rotary_factor: float = 1.0,
                 norm_eps: float = 1e-6):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, window_size, rope_theta, layer_idx)
        if not isinstance(partial_rotary_factor, (int, float)) or not 0 < partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial_rotary_factor!r}")
        rot = int(self.head_dim * partial_rotary_factor)
        if rot < 2 or rot % 2:
            raise ValueError(f"head_dim * partial_rotary_factor = {self.head_dim} * {partial_rotary_factor} must give "
                             f"an even number of rotary channels >= 2, got {rot}")
        self.rotary_dim, self.partial_rotary_factor = rot, float(partial_rotary_factor)
        self.output_gate, self.qk_norm = bool(output_gate), bool(qk_norm)
        if self.output_gate:
            self.g_proj = nn.Linear(hidden_size, self.num_heads * self.head_dim, bias=False)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=norm_eps)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, state: KVState | None = None, use_cache: bool = False,
                positions: torch.Tensor | None = None):
        """x: [B, T, D] -> (o [B, T, D], KVState or None)."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have shape [B, T, {self.hidden_size}], got {tuple(x.shape)}")
        B, T, _ = x.shape
        if attention_mask is not None and tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask must have shape [B, T] = [{B}, {T}], got {tuple(attention_mask.shape)}")
        if cu_seqlens is not None and (state is not None or use_cache):
            raise ValueError("cu_seqlens cannot be combined with a KV cache: use attention_mask (left padding) "
                             "for cached generation")
        if positions is None:
            if cu_seqlens is not None:
                positions = _seq_position(cu_seqlens, T)[0][None].expand(B, T)
            else:
                offset = 0 if state is None else state.seen
                positions = (torch.arange(T, device=x.device) + offset)[None].expand(B, T)
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = partial_rotary(q, positions, self.rope_theta, self.rotary_dim)
        k = partial_rotary(k, positions, self.rope_theta, self.rotary_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        valid = attention_mask.bool() if attention_mask is not None else torch.ones(B, T, dtype=torch.bool,
                                                                                    device=x.device)
        if state is None and (attention_mask is None or bool(valid.all())):
            o = ops.softmax_attention(q, k, v, causal=True, window_size=self.window_size, cu_seqlens=cu_seqlens)
            keys, values, kvalid = k, v, valid
        else:
            if state is not None:
                keys, values = torch.cat([state.key, k], 1), torch.cat([state.value, v], 1)
                kvalid = torch.cat([state.valid, valid], 1)
            else:
                keys, values, kvalid = k, v, valid
            o = self._masked(q, keys, values, kvalid)
        o = o.reshape(B, T, self.num_heads * self.head_dim)
        if self.output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        o = self.o_proj(o)
        if not use_cache:
            return o, None
        if self.window_size is not None:
            keep = self.window_size - 1
            keys, values, kvalid = (t[:, t.shape[1] - min(keep, t.shape[1]):] for t in (keys, values, kvalid))
        seen = T + (0 if state is None else state.seen)
        return o, KVState(keys.contiguous(), values.contiguous(), kvalid.contiguous(), self.window_size, seen)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", rotary_dim={self.rotary_dim}, output_gate={self.output_gate}, "
                f"qk_norm={self.qk_norm}")


def attention_options(config) -> dict:
    """The gated-attention options a config carries (``OPTION_DEFAULTS`` where absent)."""
    return {name: getattr(config, name, default) for name, default in OPTION_DEFAULTS.items()}


def wants_gated_attention(config) -> bool:
    """True when the config's attention layers need :class:`GatedAttention`."""
    return attention_options(config) != OPTION_DEFAULTS


def build_gated_attention(config, layer_idx: int) -> GatedAttention:
    """The attention mixer of layer ``layer_idx`` of a :class:`gdn.models.GDNConfig` carrying the options."""
    opts = attention_options(config)
    letter = config.layer_pattern[layer_idx]
    return GatedAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                          config.resolved_attention_head_dim,
                          window_size=config.window_size if letter == "S" else None, rope_theta=config.rope_theta,
                          layer_idx=layer_idx, output_gate=opts["attention_output_gate"],
                          qk_norm=opts["attention_qk_norm"], partial_rotary_factor=opts["partial_rotary_factor"],
                          norm_eps=config.norm_eps)


def apply_attention_options(model) -> int:
    """Replace the plain attention mixers of a built :class:`gdn.models.GDNForCausalLM` (or GDNModel)
    by :class:`GatedAttention` when its config asks for it. Returns the number replaced (new
    modules start from fresh weights: load the checkpoint afterwards)."""
    config = model.config
    if not wants_gated_attention(config):
        return 0
    base = getattr(model, "model", model)
    replaced = 0
    for i, block in enumerate(base.layers):
        if isinstance(block.mixer, Attention) and not isinstance(block.mixer, GatedAttention):
            ref = block.mixer.q_proj.weight
            block.mixer = build_gated_attention(config, i).to(device=ref.device, dtype=ref.dtype)
            replaced += 1
    return replaced
