"""Softmax attention layer: RoPE, grouped query heads, optional sliding window, SDPA, KV cache,
and the options of Qwen3-Next / Qwen3.5's gated attention (q/k norm, partial rotary, output gate)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..distributed import attention as cp_attention
from .fused import FusedLinear
from .recurrent import positive_int
from ..ops.conv import seq_position
from ..ops.gemv import decode_linear
from .norm import RMSNorm
from .state import KVState

#: Query block of the explicit-mask path (padded batches, continuations from a cache).
QUERY_BLOCK = 1024


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None = None) -> torch.Tensor:
    """Rotary position embedding (rotate-half form), computed in fp32.

    x: [B, T, H, D]; positions: [B, T] or [T] integer; rotary_dim: the leading channels of each head
    that rotate (even; default all D, which must then be even), the rest pass through unchanged.
    Returns [B, T, H, D] in x.dtype.
    """
    D = x.shape[-1]
    R = D if rotary_dim is None else rotary_dim
    if R % 2 or not 0 < R <= D:
        raise ValueError(f"rotary_dim must be even and in [2, {D}], got {R}")
    inv_freq = theta ** (-torch.arange(0, R, 2, device=x.device, dtype=torch.float32) / R)
    pos = positions.to(x.device, torch.float32)
    if pos.dim() == 1:
        pos = pos[None]
    ang = pos[..., None] * inv_freq  # [B, T, R/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None], torch.cat([ang.sin(), ang.sin()], -1)[:, :, None]
    xf = x[..., :R].float()
    x1, x2 = xf[..., : R // 2], xf[..., R // 2:]
    out = (xf * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)
    return out if R == D else torch.cat([out, x[..., R:]], -1)


class Attention(nn.Module):
    """Causal softmax attention with RoPE and grouped query heads; global or sliding-window;
    optionally Qwen3-Next / Qwen3.5's gated attention (q/k RMSNorm, partial rotary, output gate).

    Args:
        hidden_size: model width D.
        num_heads: HQ query heads.
        num_kv_heads: HKV key/value heads (HQ a multiple of it; default HQ).
        head_dim: per-head size (even, for RoPE); default D / HQ.
        window_size: None (global) or W: query t sees keys t−W+1..t.
        rope_theta: RoPE base.
        layer_idx: index in the stack (informational).
        output_gate: multiply the attention output [B, T, HQ·head_dim] by ``sigmoid(g_proj x)``
            before ``o_proj`` (adds ``g_proj``: D -> HQ·head_dim).
        qk_norm: RMSNorm over the head dim of every query and key head, before RoPE (adds
            ``q_norm`` / ``k_norm``, weight [head_dim], epsilon ``norm_eps``).
        partial_rotary_factor: fraction of each head's channels that RoPE rotates (the leading
            ``int(head_dim · factor)`` = ``rotary_dim`` channels, an even number >= 2); 1.0 = all.
        norm_eps: epsilon of the q/k norms.

    Forward: ``x`` [B, T, D]; ``attention_mask`` [B, T] (1 token / 0 padding; padded keys are
    never attended); ``cu_seqlens`` [N+1] (B == 1); ``state``: :class:`KVState` from the previous
    call; ``use_cache``: return the new state; ``positions`` [B, T] RoPE positions (default: the
    index within the sequence, continuing after the cache); ``context_parallel``: a
    :class:`gdn.distributed.ContextParallel` when x is this rank's slice of sequences split across
    ranks (layout and default positions from it; no mask, cu_seqlens, state or cache): a sliding
    window fetches the window's keys from the ranks before, global attention all-gathers them
    (:mod:`gdn.distributed.attention`). Returns ``(o [B, T, D], KVState or None)``.
    Whole unpadded sequences go through :func:`gdn.ops.softmax_attention` (SDPA, blocked sliding
    window); padded batches and continuations through SDPA with an explicit mask over cache + new keys.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 window_size: int | None = None, rope_theta: float = 10000.0, layer_idx: int | None = None, *,
                 output_gate: bool = False, qk_norm: bool = False, partial_rotary_factor: float = 1.0,
                 norm_eps: float = 1e-6):
        super().__init__()
        self.hidden_size = positive_int("hidden_size", hidden_size)
        self.num_heads = positive_int("num_heads", num_heads)
        self.num_kv_heads = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}), "
                                 "or give head_dim")
            head_dim = hidden_size // num_heads
        self.head_dim = positive_int("head_dim", head_dim)
        for name, flag in (("output_gate", output_gate), ("qk_norm", qk_norm)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if (isinstance(partial_rotary_factor, bool) or not isinstance(partial_rotary_factor, (int, float))
                or not 0 < partial_rotary_factor <= 1):
            raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {partial_rotary_factor!r}")
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"head_dim * partial_rotary_factor ({head_dim} * {partial_rotary_factor}) must give an "
                             f"even number >= 2 of rotary channels for RoPE, got {self.rotary_dim}")
        if window_size is not None:
            positive_int("window_size", window_size)
        self.window_size, self.rope_theta, self.layer_idx = window_size, float(rope_theta), layer_idx
        self.output_gate, self.qk_norm, self.partial_rotary_factor = output_gate, qk_norm, float(partial_rotary_factor)
        D, HQ, HKV = hidden_size, self.num_heads, self.num_kv_heads
        self.q_proj = nn.Linear(D, HQ * head_dim, bias=False)
        self.k_proj = nn.Linear(D, HKV * head_dim, bias=False)
        self.v_proj = nn.Linear(D, HKV * head_dim, bias=False)
        self.o_proj = nn.Linear(HQ * head_dim, D, bias=False)
        if output_gate:
            self.g_proj = nn.Linear(D, HQ * head_dim, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor, *, queries: bool = True):
        """(q, k, v) of ``x`` [B, T, D] at RoPE ``positions`` [B, T]: the projections, the q/k norms
        and RoPE. q: [B, T, HQ, hd] (None with ``queries=False``); k, v: [B, T, HKV, hd]."""
        return self._heads(self.q_proj(x) if queries else None, self.k_proj(x), self.v_proj(x), positions)

    def _heads(self, q, k, v, positions):
        """The projections q [B, T, HQ·hd] (or None), k, v [B, T, HKV·hd] as heads, with the q/k
        norms and RoPE at ``positions`` [B, T] applied: what :meth:`project` returns."""
        B, T = k.shape[:2]
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        q = None if q is None else q.view(B, T, self.num_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
            q = None if q is None else self.q_norm(q)
        k = rotary(k, positions, self.rope_theta, self.rotary_dim)
        q = None if q is None else rotary(q, positions, self.rope_theta, self.rotary_dim)
        return q, k, v.view(B, T, self.num_kv_heads, self.head_dim)

    def decode_weights(self) -> FusedLinear:
        """q, k, v (and the output gate's ``g_proj``) as one weight, for :meth:`decode_into`."""
        names = ("q_proj", "k_proj", "v_proj") + (("g_proj",) if self.output_gate else ())
        return FusedLinear({name: getattr(self, name) for name in names})

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, state: KVState | None = None, use_cache: bool = False,
                positions: torch.Tensor | None = None, context_parallel=None):
        """x: [B, T, D] -> (o [B, T, D], KVState or None)."""
        cp = context_parallel
        if cp is not None and (attention_mask is not None or cu_seqlens is not None or state is not None or use_cache):
            raise ValueError("with context_parallel the layout comes from it: no attention_mask, cu_seqlens, state "
                             "or use_cache")
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have shape [B, T, {self.hidden_size}], got {tuple(x.shape)}")
        B, T, _ = x.shape
        if attention_mask is not None and tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask must have shape [B, T] = [{B}, {T}], got {tuple(attention_mask.shape)}")
        if cu_seqlens is not None and (state is not None or use_cache):
            raise ValueError("cu_seqlens cannot be combined with a KV cache: use attention_mask (left padding) "
                             "for cached generation")
        if positions is None:
            if cp is not None:
                positions = cp.positions(x.device)[None].expand(B, T)
            elif cu_seqlens is not None:
                positions = seq_position(cu_seqlens, T)[0][None].expand(B, T)
            else:
                offset = 0 if state is None else state.seen
                positions = (torch.arange(T, device=x.device) + offset)[None].expand(B, T)
        q, k, v = self.project(x, positions)
        valid = attention_mask.bool() if attention_mask is not None else torch.ones(B, T, dtype=torch.bool,
                                                                                    device=x.device)
        if cp is not None:
            o = cp_attention.softmax_attention(q, k, v, cp=cp, window_size=self.window_size)
        elif state is None and (attention_mask is None or bool(valid.all())):
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

    def decode_into(self, x: torch.Tensor, state: KVState, slot: torch.Tensor, positions: torch.Tensor,
                    weights: FusedLinear) -> torch.Tensor:
        """One decode step into preallocated key/value buffers: x [B, 1, D] -> o [B, 1, D].

        ``state``: a :class:`KVState` of fixed-size buffers key/value [B, L, HKV, D] and valid [B, L]
        (L = the maximum length for global attention, the window for a sliding window, used as a
        ring); ``slot``: [] long device tensor, the buffer slot the new key goes to (the caller
        wraps it for a ring); ``positions``: [B] long device tensor, the RoPE position of the new
        token; ``weights``: :meth:`decode_weights`, one GEMM for every projection of x. The new key
        and value are written in place and the query attends to every valid slot
        (a ring of ``window`` slots holds exactly the keys the window sees); no shape depends on the
        length, nothing syncs with the host. Equals :meth:`forward` with a cache up to the order of
        the softmax sums.
        """
        return self.decode_from(decode_linear(x, weights.weight), state, slot, positions, weights)

    @staticmethod
    def decode_input(weights: FusedLinear) -> FusedLinear:
        """The joined input projection of :meth:`decode_weights`' ``weights`` (all of it)."""
        return weights

    def decode_from(self, y: torch.Tensor, state: KVState, slot: torch.Tensor, positions: torch.Tensor,
                    weights: FusedLinear) -> torch.Tensor:
        """:meth:`decode_into` from the joined input projection ``y`` = x W_inᵀ [B, 1, Σ out]."""
        B = y.shape[0]
        p = weights.split(y)
        q, k, v = self._heads(p["q_proj"], p["k_proj"], p["v_proj"], positions[:, None])
        idx = slot.reshape(1)
        state.key.index_copy_(1, idx, k.to(state.key.dtype))
        state.value.index_copy_(1, idx, v.to(state.value.dtype))
        state.valid.index_fill_(1, idx, True)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), state.key.transpose(1, 2), state.value.transpose(1, 2),
                                           attn_mask=state.valid[:, None, None, :],
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        o = o.transpose(1, 2).reshape(B, 1, self.num_heads * self.head_dim)
        if self.output_gate:
            o = o * torch.sigmoid(p["g_proj"])
        return decode_linear(o, self.o_proj.weight)

    def _masked(self, q, keys, values, kvalid):
        """q: [B, Tq, HQ, D] (the last Tq of Tk slots); keys/values: [B, Tk, HKV, D]; kvalid: [B, Tk].

        Queries go in blocks of :data:`QUERY_BLOCK` against only the keys they can see, so the
        explicit mask is at most [B, QUERY_BLOCK, QUERY_BLOCK + window] (or + Tk for global)."""
        Tq, Tk = q.shape[1], keys.shape[1]
        W = self.window_size
        outs = []
        for s in range(0, Tq, QUERY_BLOCK):
            e = min(Tq, s + QUERY_BLOCK)
            lo = 0 if W is None else max(0, Tk - Tq + s - W + 1)
            hi = Tk - Tq + e
            qs = torch.arange(Tk - Tq + s, hi, device=q.device)[:, None]
            ks = torch.arange(lo, hi, device=q.device)[None, :]
            allowed = ks <= qs
            if W is not None:
                allowed &= (qs - ks) < W
            # Padded keys are never seen; every query sees itself, so a row is never empty (no NaN).
            mask = (allowed[None] & kvalid[:, None, lo:hi]) | (ks == qs)[None]
            o = F.scaled_dot_product_attention(q[:, s:e].transpose(1, 2), keys[:, lo:hi].transpose(1, 2),
                                               values[:, lo:hi].transpose(1, 2), attn_mask=mask[:, None],
                                               enable_gqa=self.num_heads != self.num_kv_heads)
            outs.append(o.transpose(1, 2))
        return torch.cat(outs, 1)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"window={self.window_size}, rope_theta={self.rope_theta}, rotary_dim={self.rotary_dim}, "
                f"output_gate={self.output_gate}, qk_norm={self.qk_norm}")
