"""The skeleton shared by the four recurrent mixers (Gated DeltaNet, DeltaNet, gated linear
attention, linear attention).

    x ─ q_proj ─ conv+SiLU ─ L2 norm ─┐
    x ─ k_proj ─ conv+SiLU ─ L2 norm ─┤
    x ─ v_proj ─ conv+SiLU ───────────┼─ recurrence (gdn.ops) ─ RMSNorm per head (× SiLU(g_proj x)) ─ o_proj
    x ─ a_proj, b_proj (gate, β) ─────┘

Subclasses say which of the gate (decay) and the delta term (β) they have and implement
:meth:`RecurrentMixer._mix`. The projections of x run as one product of their joined weights
(:meth:`RecurrentMixer.project`). The decode step (:meth:`RecurrentMixer.decode_into`) computes every
projection of x with one GEMM (:class:`gdn.layers.fused.FusedLinear`) and updates the matrix state in
place (:func:`gdn.ops.recurrent_step_`). Padding (``attention_mask``) zeroes k and v and the decay at padded
tokens so they leave the state unchanged; packing (``cu_seqlens``) restarts every sequence.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import halo
from ..ops.conv import conv_step_
from ..ops.gemv import decode_linear
from ..ops.joined import split_columns, view_block
from ..ops.library import autocast_of
from .conv import ShortConvolution, convolve
from .fused import FusedLinear, FusedWeight, joinable, joined_weight
from .norm import GatedRMSNorm, RMSNorm
from .state import RecurrentState

#: Value given to the gate pre-activation at padded tokens: softplus of it is exactly 0, so g = 0.
MASKED_GATE_INPUT = -1e4


def positive_int(name: str, val) -> int:
    if isinstance(val, bool) or not isinstance(val, int) or val < 1:
        raise ValueError(f"{name} must be a positive int, got {val!r}")
    return val


def mamba_gate_init(num_heads: int, dt_min: float = 1e-3, dt_max: float = 0.1,
                    a_min: float = 0.01, a_max: float = 16.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial ``(A_log, dt_bias)`` [HV] each (fp32): ``A_log = log U(a_min, a_max)``, ``dt_bias`` the
    inverse softplus of dt, log-uniform in [dt_min, dt_max]."""
    A = torch.empty(num_heads).uniform_(a_min, a_max)
    dt = torch.exp(torch.rand(num_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=1e-4)
    return torch.log(A), dt + torch.log(-torch.expm1(-dt))


class RecurrentMixer(nn.Module):
    """Base of the recurrent token mixers (see the module docstring for the data flow).

    Args:
        hidden_size: model width D.
        num_heads: H query/key heads.
        head_dim: K, the query/key head size.
        num_v_heads: HV value heads (a multiple of H; default H). Value head j reads q/k head j // (HV/H).
        expand_v: value head size V = K · expand_v (must give an integer).
        use_short_conv: causal depthwise conv (kernel ``conv_size``) + SiLU on q, k, v; else SiLU only.
        conv_size: kernel of the short convolutions.
        use_gate: output gate SiLU(g_proj x) on the normalised output.
        norm_eps: epsilon of the output RMSNorm.
        layer_idx: index in the stack (informational).

    Forward: ``x`` [B, T, D]; ``attention_mask`` [B, T] (1 token / 0 padding); ``cu_seqlens`` [N+1]
    (B == 1); ``state``: :class:`RecurrentState` of the previous call (batch B); ``use_cache``:
    return the new state; ``context_parallel``: a :class:`gdn.distributed.ContextParallel` when x
    is this rank's slice of sequences split across ranks (the layout, also the packed offsets, is
    the context's; no mask, cu_seqlens, state or cache). Returns ``(o [B, T, D], RecurrentState or None)``.
    """

    has_decay = False
    has_delta = False

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, num_v_heads: int | None = None,
                 expand_v: float = 1.0, use_short_conv: bool = True, conv_size: int = 4, use_gate: bool = True,
                 norm_eps: float = 1e-6, layer_idx: int | None = None):
        super().__init__()
        self.hidden_size = positive_int("hidden_size", hidden_size)
        self.num_heads = positive_int("num_heads", num_heads)
        self.head_dim = positive_int("head_dim", head_dim)
        self.num_v_heads = num_heads if num_v_heads is None else positive_int("num_v_heads", num_v_heads)
        if self.num_v_heads % self.num_heads != 0:
            raise ValueError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_heads ({num_heads})")
        v_dim = head_dim * expand_v
        if not isinstance(expand_v, (int, float)) or expand_v <= 0 or abs(v_dim - round(v_dim)) > 1e-9:
            raise ValueError(f"expand_v must be positive with head_dim * expand_v an integer, got {head_dim} * {expand_v!r}")
        self.head_v_dim = int(round(v_dim))
        self.use_short_conv, self.use_gate, self.layer_idx = bool(use_short_conv), bool(use_gate), layer_idx
        self.conv_size = positive_int("conv_size", conv_size)
        D, H, HV, K, V = hidden_size, num_heads, self.num_v_heads, head_dim, self.head_v_dim
        self.key_dim, self.value_dim = H * K, HV * V
        self.q_proj = nn.Linear(D, self.key_dim, bias=False)
        self.k_proj = nn.Linear(D, self.key_dim, bias=False)
        self.v_proj = nn.Linear(D, self.value_dim, bias=False)
        if self.use_short_conv:
            self.q_conv = ShortConvolution(self.key_dim, conv_size)
            self.k_conv = ShortConvolution(self.key_dim, conv_size)
            self.v_conv = ShortConvolution(self.value_dim, conv_size)
        if self.has_decay:
            self.a_proj = nn.Linear(D, HV, bias=False)
            A_log, dt_bias = mamba_gate_init(HV)
            self.A_log = nn.Parameter(A_log)
            self.dt_bias = nn.Parameter(dt_bias)
            self.A_log._no_weight_decay = True
            self.dt_bias._no_weight_decay = True
        if self.has_delta:
            self.b_proj = nn.Linear(D, HV, bias=False)
        if self.use_gate:
            self.g_proj = nn.Linear(D, self.value_dim, bias=False)
            self.o_norm = GatedRMSNorm(V, eps=norm_eps)
        else:
            self.o_norm = RMSNorm(V, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, D, bias=False)

    def gate_init_values(self) -> dict[str, torch.Tensor]:
        """Fresh initial values of the gate parameters (empty for members without a decay)."""
        if not self.has_decay:
            return {}
        A_log, dt_bias = mamba_gate_init(self.num_v_heads)
        return {"A_log": A_log, "dt_bias": dt_bias}

    def state_shape(self, batch_size: int) -> dict[str, tuple[int, ...]]:
        """Shapes of the decoding state for ``batch_size`` sequences."""
        W = self.conv_size - 1
        conv = [(batch_size, self.key_dim, W)] * 2 + [(batch_size, self.value_dim, W)] if self.use_short_conv else []
        return {"conv": tuple(conv), "recurrent": (batch_size, self.num_v_heads, self.head_dim, self.head_v_dim)}

    def input_projections(self) -> tuple[str, ...]:
        """Names of the linear layers that read the mixer's input x, q, k and v first (what
        :meth:`decode_weights` fuses)."""
        return ("q_proj", "k_proj", "v_proj") + tuple(n for n in ("a_proj", "b_proj", "g_proj") if hasattr(self, n))

    def decode_weights(self) -> tuple[FusedLinear, FusedWeight | None]:
        """For :meth:`decode_into`: the projections of :meth:`input_projections` as one weight, and the
        q, k, v convolutions' weights as one (None without short convolutions)."""
        convs = FusedWeight({"q": self.q_conv, "k": self.k_conv, "v": self.v_conv}) if self.use_short_conv else None
        return FusedLinear({name: getattr(self, name) for name in self.input_projections()}), convs

    def _mix(self, q, k, v, proj, mask, initial_state, output_final_state, cu_seqlens, context_parallel=None,
             update=None):
        """q, k: [B, T, H, K] (after conv, before L2 norm); v: [B, T, HV, V]; proj: ``proj(name)`` is
        the projection ``name`` (one of :meth:`input_projections`) of x, [B, T, ·]; mask: [B, T] bool
        or None; context_parallel: run the op of :mod:`gdn.distributed.recurrent` with it; update: a
        decode step (T = 1) that writes the new state into this [B, HV, K, V] buffer, which also
        holds the state it starts from. Returns (o [B, T, HV, V], state or None; None with update)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, state: RecurrentState | None = None,
                use_cache: bool = False, context_parallel=None):
        """x: [B, T, D] -> (o [B, T, D], RecurrentState or None)."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have shape [B, T, {self.hidden_size}], got {tuple(x.shape)}")
        B, T, _ = x.shape
        cp = context_parallel
        if cp is not None and (attention_mask is not None or cu_seqlens is not None or state is not None or use_cache):
            raise ValueError("with context_parallel the layout comes from it: no attention_mask, cu_seqlens, state "
                             "or use_cache")
        mask = None
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (B, T):
                raise ValueError(f"attention_mask must have shape [B, T] = [{B}, {T}], got {tuple(attention_mask.shape)}")
            mask = attention_mask.bool()
        if state is not None and cu_seqlens is not None:
            raise ValueError("state cannot be combined with cu_seqlens: packed sequences start from zero state")
        conv_states = state.conv if state is not None and state.conv else (None, None, None)

        projected = self.project(x)

        def proj(name):
            return projected[name]

        q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
        new_conv: tuple[torch.Tensor, ...] = ()
        if self.use_short_conv and cp is not None:  # one halo exchange for the three convolutions
            h = halo(torch.cat([q, k, v], -1), self.conv_size - 1, cp).split([self.key_dim, self.key_dim,
                                                                                self.value_dim], -1)
            q, k, v = (conv(t, context_parallel=cp, halo=ht)[0]
                       for conv, t, ht in zip((self.q_conv, self.k_conv, self.v_conv), (q, k, v), h))
        elif self.use_short_conv:
            (q, sq), (k, sk), (v, sv) = convolve((self.q_conv, self.k_conv, self.v_conv), (q, k, v), mask=mask,
                                                 cu_seqlens=cu_seqlens, states=conv_states, output_state=use_cache)
            new_conv = (sq, sk, sv) if use_cache else ()
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        if mask is not None:
            m = mask[..., None].to(k.dtype)
            k, v = k * m, v * m
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_heads, self.head_dim)
        v = v.view(B, T, self.num_v_heads, self.head_v_dim)
        if cp is None:
            o, S = self._mix(q, k, v, proj, mask, None if state is None else state.recurrent, use_cache, cu_seqlens)
        else:
            o, S = self._mix(q, k, v, proj, None, None, False, None, context_parallel=cp)
        if self.use_gate:
            o = self.o_norm(o, view_block(proj("g_proj"), B, T, self.num_v_heads, self.head_v_dim))
        else:
            o = self.o_norm(o)
        o = self.o_proj(o.reshape(B, T, self.value_dim))
        return o, (RecurrentState(new_conv, S) if use_cache else None)

    def project(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every projection of :meth:`input_projections` of x, name -> [B, T, out]. Where each is a
        plain bias-free ``nn.Linear`` that no hook watches: one product with their weights joined
        (x read once, one launch instead of six, and the backward's dx one product instead of a sum
        of six), the outputs its column blocks; else each layer is called (a wrapped or hooked layer,
        e.g. a LoRA adapter's or a quantised one, keeps its own forward)."""
        names = self.input_projections()
        mods = [getattr(self, n) for n in names]
        if not joinable(mods):
            return {n: m(x) for n, m in zip(names, mods)}
        # blocks whose width is a multiple of 8 first, the narrow gate inputs (a, b) last, and the
        # width padded to a multiple of 8: in 16 bits every row and every wide block then starts on
        # 16 bytes, which the glue kernels reading them in place need for vector loads and stores
        order = sorted(range(len(mods)), key=lambda i: mods[i].out_features % 8 != 0)
        names, mods = [names[i] for i in order], [mods[i] for i in order]
        sizes = [m.out_features for m in mods]
        pad = -sum(sizes) % 8
        y = F.linear(x, joined_weight([m.weight for m in mods], autocast_of(x), pad))
        # the blocks' gradients come back in one tensor, those of the short convolutions and the
        # output norm's gate written in place by their kernels (gdn.ops.joined)
        return dict(zip(names, split_columns(y, sizes + [pad])))

    def decode_into(self, x: torch.Tensor, state: RecurrentState, weights) -> torch.Tensor:
        """One decode step that updates ``state`` in place: x [B, 1, D] -> o [B, 1, D].

        ``state`` holds preallocated buffers (the conv tails as one buffer ``tails`` [B, ΣD, K-1],
        recurrent [B, HV, K, V]) whose storage never changes, and the step has fixed shapes and no
        host sync (what a CUDA graph capture needs). ``weights``: :meth:`decode_weights` of this
        mixer: one GEMM gives every projection of x, and q, k, v (adjacent in its output) go
        through one depthwise convolution over their channels (:func:`gdn.ops.conv.conv_step_`,
        tails updated in place). The matrix state is updated in place by
        :func:`gdn.ops.recurrent_step_` (or the member's step op). The numbers are those of
        :meth:`forward` with ``state`` and ``use_cache=True``.
        """
        return self.decode_from(decode_linear(x, weights[0].weight), state, weights)

    @staticmethod
    def decode_input(weights) -> FusedLinear:
        """The joined input projection of :meth:`decode_weights`' ``weights``."""
        return weights[0]

    def decode_from(self, y: torch.Tensor, state: RecurrentState, weights) -> torch.Tensor:
        """:meth:`decode_into` from the joined input projection ``y`` = x W_inᵀ [B, 1, Σ out] (the
        caller may have formed it together with the norm before it)."""
        B = y.shape[0]
        proj, convs = weights
        p = proj.split(y)
        sizes = [self.key_dim, self.key_dim, self.value_dim]
        qkv = y[..., : sum(sizes)]  # q, k, v lead the projections
        if self.use_short_conv:
            qkv = conv_step_(qkv, convs.weight, state.tails, self.q_conv.activation)
        else:
            qkv = F.silu(qkv)
        q, k, v = qkv.split(sizes, -1)
        q = q.view(B, 1, self.num_heads, self.head_dim)
        k = k.view(B, 1, self.num_heads, self.head_dim)
        v = v.view(B, 1, self.num_v_heads, self.head_v_dim)
        o, _ = self._mix(q, k, v, p.__getitem__, None, None, False, None, update=state.recurrent)
        if self.use_gate:
            o = self.o_norm(o, p["g_proj"].view(B, 1, self.num_v_heads, self.head_v_dim))
        else:
            o = self.o_norm(o)
        return decode_linear(o.reshape(B, 1, self.value_dim), self.o_proj.weight)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, v_heads={self.num_v_heads}, head_dim={self.head_dim}, "
                f"head_v_dim={self.head_v_dim}, short_conv={self.use_short_conv}, gate={self.use_gate}")
