"""Context-parallel recurrent ops: every member of the delta family and Kimi Delta Attention over a
sequence split along T across the ranks of a group (docs/CONTEXT_PARALLEL.md).

A stretch of tokens maps the state affinely, ``S ↦ M S + b``: ``M`` is the product of the
transitions (``e^g (I − β k kᵀ)``, K×K per head) and ``b`` the state the stretch produces from
zero. Outputs are affine in the start state too:

    o_t(S0) = o_t(0) + S0ᵀ R_t,      R_t = scale · P_tᵀ q_t,      P_t = A_t ⋯ A_1 (K×K)

Each rank, with the public op of :mod:`gdn.ops` (Triton on CUDA, the chunk form on the CPU):

1. runs its slice with its own sequences' true initial states and zero for the sequence it
   continues: outputs ``o(0)``, final states (``b`` of the sequence it passes on);
2. runs the continued stretch once more with the state ``I`` (K×K) and values 0, which gives
   ``M`` (its final state) and every ``R_t`` (its outputs): the columns of a state evolve
   independently, so a start state ``[I]`` carries the transition product itself. Linear and
   gated linear attention skip it: ``P_t = exp(Σ g) I``;
3. all-gathers ``(M, b)`` of every rank (one collective), composes the ranks before it into its
   true start state ``S0 = M_{r−1}(⋯(M_0·0 + b_0)⋯) + b_{r−1}``;
4. corrects ``o_t += S0ᵀ R_t`` on the continued stretch and its final state ``+= M S0``.

Steps 1 and 2 do not wait for other ranks; the exchange and the correction are small. Compute:
the slice's op with V value columns plus the continued stretch with K (≈ 2× at K = V, 1× for
linear / gated linear attention). The backward is autograd through the ops and the correction,
and the adjoint of the exchange (one reduce-scatter) in :class:`_PrefixScan`.

Initial states come in global (``[N, HV, K, V]``, the same tensor on every rank): each rank reads
the rows of the sequences starting in its slice, so its gradient holds only those rows (sum over
the group for the full gradient). Final states come back ``[N, HV, K, V]`` with the rows of the
sequences that end on this rank (:attr:`gdn.distributed.LocalLayout.owned`) and zeros elsewhere:
the sum over the group is the global final state.
"""
from __future__ import annotations

import torch

from .. import ops
from .comm import gather_stack, reduce_scatter_stack

__all__ = ["linear_attention", "gated_linear_attention", "delta_rule", "gated_delta_rule", "gated_delta_rule_fused",
           "kimi_delta_attention"]


class _PrefixScan(torch.autograd.Function):
    """``(S0, o)`` from this rank's map ``Mb = [M | b]`` [P, HV, K, K+V]: the all-gather of every
    rank's map and the composition of those before this rank, ``X_0 = 0, X_{j+1} = M_j X_j + b_j``,
    ``S0 = X_rank``. ``o`` passes through unchanged: it ties the node into every rank's graph, so
    its backward (which holds the reduce-scatter) runs on all ranks, also where ``S0`` is unused.
    Only the earlier ranks' maps are kept for the backward; it recomputes the X_j from them."""

    @staticmethod
    def forward(ctx, Mb, o, cp):
        maps = gather_stack(Mb, cp.group)[: cp.rank]  # [r, P, HV, K, K+V]: the ranks before this one
        ctx.cp, ctx.shape = cp, Mb.shape
        ctx.save_for_backward(maps)
        K = Mb.shape[-2]
        return _compose(maps, Mb.new_zeros((*Mb.shape[:-1], Mb.shape[-1] - K)))[-1], o.view_as(o)

    @staticmethod
    def backward(ctx, dS, do):
        (maps,) = ctx.saved_tensors
        cp, K = ctx.cp, ctx.shape[-2]
        X = _compose(maps, torch.zeros_like(dS))
        dmaps = dS.new_zeros((cp.size, *ctx.shape))
        g = dS
        for j in range(cp.rank - 1, -1, -1):  # X_{j+1} = M_j X_j + b_j
            dmaps[j][..., K:] = g
            dmaps[j][..., :K] = torch.matmul(g, X[j].mT)
            g = torch.matmul(maps[j][..., :K].mT, g)
        return reduce_scatter_stack(dmaps, cp.group), do, None


class _Correct(torch.autograd.Function):
    """``o + S0ᵀ R`` per token and head: o [P, L, HV, V], R [P, L, HV, K] (both in the op's output
    dtype), S0 [P, HV, K, V] (fp32/fp64). The product runs in S0's dtype; R is kept for the backward
    in its own dtype (autograd's einsum would keep an fp32 copy: 4·K bytes per token and head)."""

    @staticmethod
    def forward(ctx, o, R, S0):
        ctx.save_for_backward(R, S0)
        return (o.to(S0.dtype) + torch.einsum("blhk,bhkv->blhv", R.to(S0.dtype), S0)).to(o.dtype)

    @staticmethod
    def backward(ctx, do):
        R, S0 = ctx.saved_tensors
        d = do.to(S0.dtype)
        dR = torch.einsum("blhv,bhkv->blhk", d, S0).to(R.dtype) if ctx.needs_input_grad[1] else None
        dS0 = torch.einsum("blhk,blhv->bhkv", R.to(S0.dtype), d)
        return do, dR, dS0


def _compose(maps, x0):
    """``[X_0 = x0, X_1, …, X_r]`` with ``X_{j+1} = M_j X_j + b_j`` for maps [r, P, HV, K, K+V]."""
    K = maps.shape[-2]
    X = [x0]
    for j in range(maps.shape[0]):
        X.append(torch.matmul(maps[j][..., :K], X[-1]) + maps[j][..., K:])
    return X


def _check(cp, q, v, initial_state):
    B, T = v.shape[:2]
    if T != cp.length:
        raise ValueError(f"this rank holds tokens [{cp.start}, {cp.end}) ({cp.length}) but the inputs have T = {T}")
    if cp.cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"packed sequences (cu_seqlens) need B == 1, got B = {B}")
        N = len(cp.cu_seqlens) - 1
    else:
        N = B
    HV, V, K = v.shape[2], v.shape[3], q.shape[3]
    if initial_state is not None and tuple(initial_state.shape) != (N, HV, K, V):
        raise ValueError(f"initial_state must have the global shape [N, HV, K, V] = {[N, HV, K, V]}, "
                         f"got {list(initial_state.shape)}")
    return N


def _context_parallel(call, tokens: dict, cp, initial_state, output_final_state, transfer=None):
    """The four steps of the module docstring for one op.

    call(tokens, initial_state, cu_seqlens) -> (o, final state) runs the public op on a dict of
    per-token tensors [B, T, ...] (``tokens["v"]`` the values). ``transfer(L)`` -> (R [P, L, HV, K],
    M [P, HV, K, K]) of the first L tokens when a closed form exists (linear members), else the
    identity-state pass computes them.
    """
    q, v = tokens["q"], tokens["v"]
    B, T, HV, V = v.shape
    K = q.shape[3]
    N = _check(cp, q, v, initial_state)
    lay = cp.layout
    rows = cp.cu_seqlens is None

    # 1. the slice from its sequences' own initial states, zero for the continued one
    if rows:
        init = initial_state if cp.rank == 0 else None
    elif initial_state is None:
        init = None
    else:
        init = initial_state.index_select(0, torch.tensor(lay.index, device=initial_state.device))
        if lay.carry_in:
            init = torch.cat([torch.zeros_like(init[:1]), init[1:]])
    o, F = call(tokens, init, cp.local_cu_seqlens(v.device))
    sdt = F.dtype
    P = B if rows else 1  # sequences crossing a rank boundary

    # 2. the transfer of the continued stretch: R_t and M
    L = lay.carry_in
    if L:
        if transfer is not None:
            R, M_in = transfer(L)
        else:
            eye = torch.eye(K, dtype=sdt, device=v.device).expand(P, HV, K, K).contiguous()
            part = {name: t[:, :L] for name, t in tokens.items()}
            part["v"] = v.new_zeros(P, L, HV, K)
            R, M_in = call(part, eye, None)

    # 3. this rank's map, the exchange, the start state of the continued sequence
    if lay.carry_out:
        b = F[F.shape[0] - P:]
        M = M_in if L and (rows or len(lay.index) == 1) else torch.zeros(P, HV, K, K, dtype=sdt, device=v.device)
        Mb = torch.cat([M, b], -1)
    else:
        Mb = torch.zeros(P, HV, K, K + V, dtype=sdt, device=v.device)
    S0, o = _PrefixScan.apply(Mb, o, cp)

    # 4. the correction of the continued stretch
    if L:
        o = torch.cat([_Correct.apply(o[:, :L], R.to(o.dtype), S0), o[:, L:]], 1)
        F = torch.cat([F[:P] + torch.matmul(M_in, S0), F[P:]])
    if not output_final_state:
        return o, None
    if rows:
        return o, (F if cp.rank == cp.size - 1 else torch.zeros_like(F))
    final = F.new_zeros(N, HV, K, V)
    rows_here = [n for n, j in lay.owned if j is not None]
    if rows_here:
        src = F.index_select(0, torch.tensor([j for n, j in lay.owned if j is not None], device=F.device))
        final = final.index_copy(0, torch.tensor(rows_here, device=F.device), src)
    empty = [n for n, j in lay.owned if j is None]
    if empty and initial_state is not None:
        idx = torch.tensor(empty, device=F.device)
        final = final.index_copy(0, idx, initial_state.index_select(0, idx).to(sdt))
    return o, final


def _linear_transfer(q, g, scale, HV):
    """(R, M) of the first L tokens for the members without a delta term: ``P_t = exp(γ_t) I`` with
    γ the cumulative log decay (0 without a gate)."""
    K = q.shape[3]
    scale = K ** -0.5 if scale is None else scale

    def transfer(L):
        sdt = torch.promote_types(q.dtype, torch.float32)
        qh = q[:, :L].to(sdt).repeat_interleave(HV // q.shape[2], dim=2)  # [P, L, HV, K]
        eye = torch.eye(K, dtype=sdt, device=q.device)
        if g is None:
            return scale * qh, eye.expand(q.shape[0], HV, K, K)
        gam = g[:, :L].to(sdt).cumsum(1)  # [P, L, HV]
        return scale * torch.exp(gam)[..., None] * qh, torch.exp(gam[:, -1])[..., None, None] * eye

    return transfer


def linear_attention(q, k, v, *, cp, scale=None, initial_state=None, output_final_state=False, backend=None):
    """Context-parallel :func:`gdn.ops.linear_attention`. q, k: [B, T_r, H, K], v: [B, T_r, HV, V]:
    this rank's slice (``cp``: :class:`gdn.distributed.ContextParallel`, which holds the global
    ``cu_seqlens``); initial_state: global [N, HV, K, V]. Returns ``(o [B, T_r, HV, V], final state
    [N, HV, K, V] with this rank's rows, or None)``."""
    def call(t, init, cu):
        return ops.linear_attention(t["q"], t["k"], t["v"], scale=scale, initial_state=init, output_final_state=True,
                                    cu_seqlens=cu, backend=backend)

    return _context_parallel(call, dict(q=q, k=k, v=v), cp, initial_state, output_final_state,
                             _linear_transfer(q, None, scale, v.shape[2]))


def gated_linear_attention(q, k, v, g, *, cp, scale=None, initial_state=None, output_final_state=False,
                           backend=None):
    """Context-parallel :func:`gdn.ops.gated_linear_attention` (g: [B, T_r, HV]); see :func:`linear_attention`."""
    def call(t, init, cu):
        return ops.gated_linear_attention(t["q"], t["k"], t["v"], t["g"], scale=scale, initial_state=init,
                                          output_final_state=True, cu_seqlens=cu, backend=backend)

    return _context_parallel(call, dict(q=q, k=k, v=v, g=g), cp, initial_state, output_final_state,
                             _linear_transfer(q, g, scale, v.shape[2]))


def delta_rule(q, k, v, beta, *, cp, scale=None, initial_state=None, output_final_state=False, backend=None):
    """Context-parallel :func:`gdn.ops.delta_rule` (beta: [B, T_r, HV]); see :func:`linear_attention`."""
    def call(t, init, cu):
        return ops.delta_rule(t["q"], t["k"], t["v"], t["beta"], scale=scale, initial_state=init,
                              output_final_state=True, cu_seqlens=cu, backend=backend)

    return _context_parallel(call, dict(q=q, k=k, v=v, beta=beta), cp, initial_state, output_final_state)


def gated_delta_rule(q, k, v, g, beta, *, cp, scale=None, initial_state=None, output_final_state=False, backend=None):
    """Context-parallel :func:`gdn.ops.gated_delta_rule` (g, beta: [B, T_r, HV]); see :func:`linear_attention`."""
    def call(t, init, cu):
        return ops.gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], scale=scale, initial_state=init,
                                    output_final_state=True, cu_seqlens=cu, backend=backend)

    return _context_parallel(call, dict(q=q, k=k, v=v, g=g, beta=beta), cp, initial_state, output_final_state)


def gated_delta_rule_fused(q, k, v, a, b, A_log, dt_bias, *, cp, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm=True, allow_neg_eigval=False, backend=None):
    """Context-parallel :func:`gdn.ops.gated_delta_rule_fused` (the Gated DeltaNet layer's raw inputs:
    a, b [B, T_r, HV]; A_log, dt_bias [HV]); see :func:`linear_attention`."""
    def call(t, init, cu):
        return ops.gated_delta_rule_fused(t["q"], t["k"], t["v"], t["a"], t["b"], A_log, dt_bias, scale=scale,
                                          initial_state=init, output_final_state=True, cu_seqlens=cu,
                                          use_qk_l2norm=use_qk_l2norm, allow_neg_eigval=allow_neg_eigval,
                                          backend=backend)

    return _context_parallel(call, dict(q=q, k=k, v=v, a=a, b=b), cp, initial_state, output_final_state)


def kimi_delta_attention(q, k, v, g, beta, *, cp, scale=None, initial_state=None, output_final_state=False,
                         backend=None):
    """Context-parallel :func:`gdn.ops.kimi_delta_attention` (g: [B, T_r, HV, K], beta: [B, T_r, HV]);
    see :func:`linear_attention`."""
    def call(t, init, cu):
        return ops.kimi_delta_attention(t["q"], t["k"], t["v"], t["g"], t["beta"], scale=scale, initial_state=init,
                                        output_final_state=True, cu_seqlens=cu, backend=backend)

    return _context_parallel(call, dict(q=q, k=k, v=v, g=g, beta=beta), cp, initial_state, output_final_state)
