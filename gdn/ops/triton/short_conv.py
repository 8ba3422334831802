"""Causal depthwise short convolution (optionally followed by SiLU) on the [B, T, D] layout, forward and backward.

    y[b, t, d] = act(z[b, t, d]),   z[b, t, d] = Σ_{i<K} w[d, K-1-i] · x[b, t-i, d]

with ``x`` before token 0 taken from ``hist`` [B, D, K-1] (zeros when None), or, for packed
sequences (``cu_seqlens`` [N+1], B == 1), zero before each sequence's first token: a tap never
reads across a sequence start. The semantics are those of :func:`gdn.ops.conv.conv_act`: the
weight is rounded to x's dtype, the sum and the activation run in fp32 and y is rounded once
to x's dtype.

PyTorch runs this as a transpose, a concatenation with the history and a grouped conv1d on a
[B, D, K-1+T] copy; these kernels read the [B, T, D] tensors in place. The forward runs one
program per tile of tokens × channels. The backward recomputes z (it saves only x, the weight and
the history) and gives dx, dw (per-program fp32 partials [B, programs along T, D, K] summed by
:mod:`.colsum`) and the history's gradient (a tiny PyTorch recomputation over the first K-1 tokens);
each of its programs walks a run of tokens one row at a time, the convolution's shifts done by
renaming registers, so that every row of x and dy is read once and every dz formed once, the rows of
the next few tokens requested before this iteration's stores, since a load cannot pass an earlier
store the compiler cannot tell apart from it. (A tile form reads each row K times and needs dz on the tile's K - 1 rows past its end, through a scratch: on an H100
at the 340m model's shapes it took 1.5–1.8× the walk's time.) The forward's own walk took 1.2–1.5×
its tiles' time there: with no dz to share, the tiles' re-reads hit the cache.

Two or three convolutions whose inputs lie side by side in one tensor (a mixer's q, k and v,
column blocks of its joined input projections) run as one over all their channels
(:func:`short_conv_group`): each channel block belongs to one of them, so the kernels write each
output to its own tensor and read each one's gradient from its own, with one launch each way and
one autograd node instead of three.

    y = short_conv(x, weight, hist=None, cu_seqlens=None, activation="silu")   # autograd-aware
    q, k, v = short_conv_group((xq, xk, xv), (wq, wk, wv))                     # or None: one by one
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import offsets
from ..joined import grad_slot
from ..tuning import INTERPRET, OTHER, cdiv, pow2
from .launch import direct, sm_count
from .colsum import colsum

#: Input dtypes the kernels take.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _load_tap(x, hist, pos, o_t, o_d, m_t, m_d, b, s_xb, s_xt, D,
              J: tl.constexpr, K: tl.constexpr, HAS_HIST: tl.constexpr, PACKED: tl.constexpr):
    """x[b, t - J, d] as fp32 [BT, BD] for the tokens ``o_t`` (zero where tap J reads before the
    token's sequence start, the history where it reads before token 0); x's rows ``s_xt`` and
    batch rows ``s_xb`` elements apart."""
    src = o_t - J
    if PACKED:
        p = tl.load(pos + o_t, mask=m_t, other=0)
        ok = m_t & (p >= J)
    else:
        ok = m_t & (src >= 0)
    b_x = tl.load(x + b * s_xb + src[:, None] * s_xt + o_d[None, :], mask=ok[:, None] & m_d[None, :],
                  other=0.0).to(tl.float32)
    if HAS_HIST:
        mh = m_t & (src < 0)
        b_h = tl.load(hist + b * D * (K - 1) + o_d[None, :] * (K - 1) + (K - 1 + src)[:, None],
                      mask=mh[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_x += b_h
    return b_x


@triton.jit
def _tap_weight(w, x, o_d, m_d, J: tl.constexpr, K: tl.constexpr):
    """w[d, K-1-J] rounded to x's dtype, as fp32 [BD]."""
    return tl.load(w + o_d * K + (K - 1 - J), mask=m_d, other=0.0).to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _segment(t0, t1, t2, S1, S2, D, d0, GROUP: tl.constexpr):
    """(tensor, its channels, its first channel) of the channel block starting at d0: with GROUP, one
    of the three [B, T, ·] tensors t0, t1, t2 holding channels [0, S1), [S1, S2), [S2, D) (a block
    never straddles two: the launcher aligns the blocks to the bounds); else t0, all D channels."""
    tp = t0
    Dt = D
    c0 = D * 0
    if GROUP:
        if d0 >= S2:
            tp = t2
            Dt = D - S2
            c0 = S2
        elif d0 >= S1:
            tp = t1
            Dt = S2 - S1
            c0 = S1
        else:
            Dt = S1
    return tp, Dt, c0


@triton.jit
def _conv_fwd_kernel(x, w, hist, pos, y, y1, y2, S1, S2, T, D, s_xb, s_xt, K: tl.constexpr, HAS_HIST: tl.constexpr,
                     PACKED: tl.constexpr, SILU: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                     GROUP: tl.constexpr):
    """One program: BT tokens × BD channels of y (with GROUP: of y, y1 or y2, the convolution's
    outputs over the channel segments of :func:`_segment`)."""
    i_d, i_t, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < D
    z = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(K):
        b_x = _load_tap(x, hist, pos, o_t, o_d, m_t, m_d, b, s_xb, s_xt, D, j, K, HAS_HIST, PACKED)
        z += b_x * _tap_weight(w, x, o_d, m_d, j, K)[None, :]
    if SILU:
        z = z * tl.sigmoid(z)
    yp, Dy, c0 = _segment(y, y1, y2, S1, S2, D, i_d * BD, GROUP)
    tl.store(yp + b * T * Dy + o_t[:, None] * Dy + (o_d - c0)[None, :], z.to(y.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


@triton.jit
def _row(x, hist, t, o_d, m_d, b, s_xb, s_xt, T, D, K: tl.constexpr, HAS_HIST: tl.constexpr):
    """x[b, t, o_d] as fp32 [BD] for one token t (a scalar, possibly outside [0, T)): zero past T,
    the history before token 0 (zero without one)."""
    inside = (t >= 0) & (t < T)
    b_x = tl.load(x + b * s_xb + t * s_xt + o_d, mask=m_d & inside, other=0.0).to(tl.float32)
    if HAS_HIST:
        b_x += tl.load(hist + b * D * (K - 1) + o_d * (K - 1) + (K - 1 + t), mask=m_d & (t < 0),
                       other=0.0).to(tl.float32)
    return b_x


@triton.jit
def _pos(pos, t, T, K: tl.constexpr, PACKED: tl.constexpr):
    """Token t's index within its packed sequence when PACKED (zero outside [0, T)), else K: every
    tap of an unpacked token is valid (before token 0 it reads the history, or zeros)."""
    if PACKED:
        return tl.load(pos + t, mask=(t >= 0) & (t < T), other=0)
    return (t * 0 + K).to(tl.int32)


@triton.jit
def _dy_row(dy, b, t, o_d, m_d, T, D):
    """dy[b, t, o_d] as loaded (zero past T or where ``m_d`` is off)."""
    return tl.load(dy + b * T * D + t * D + o_d, mask=m_d & (t < T), other=0.0)


@triton.jit
def _dz_of(win, p, ws, b_dy, K: tl.constexpr, SILU: tl.constexpr):
    """dz[t] = dy[t] · act'(z[t]) as fp32 [BD] from the row ``b_dy`` = dy[t], z[t] = Σ_j w[K-1-j] ·
    x[t-j] over the taps valid at position p (p ≥ j); ``win[j]`` = x[t - j], ``ws[j]`` = w[K-1-j]."""
    z = tl.zeros([b_dy.shape[0]], dtype=tl.float32)
    for j in tl.static_range(K):
        z += tl.where(p >= j, win[j], 0.0) * ws[j]
    dz = b_dy.to(tl.float32)
    if SILU:
        sig = tl.sigmoid(z)
        dz = dz * sig * (1.0 + z * (1.0 - sig))
    return dz


@triton.jit
def _dz(win, p, ws, dy, b, t, o_d, m_d, T, D, K: tl.constexpr, SILU: tl.constexpr):
    """:func:`_dz_of` of dy[t] loaded here (zero past T)."""
    return _dz_of(win, p, ws, _dy_row(dy, b, t, o_d, m_d, T, D), K, SILU)


@triton.jit
def _walk_rows(x, hist, pos, dy, t0, o_d, o_y, m_d, b, s_xb, s_xt, T, D, Dy, K: tl.constexpr,
               HAS_HIST: tl.constexpr, PACKED: tl.constexpr, U: tl.constexpr):
    """For the U tokens t = t0, t0 - 1, ...: the input rows x[t - K + 1] (:func:`_row`), the rows
    dy[t] (as loaded) and the positions, as three tuples, all requested before any is used."""
    xs = ()
    dys = ()
    ps = ()
    for u in tl.static_range(U):
        t = t0 - u
        xs = xs + (_row(x, hist, t - K + 1, o_d, m_d, b, s_xb, s_xt, T, D, K, HAS_HIST),)
        dys = dys + (_dy_row(dy, b, t, o_y, m_d, T, Dy),)
        ps = ps + (_pos(pos, t, T, K, PACKED),)
    return xs, dys, ps


@triton.jit
def _conv_bwd_kernel(x, w, hist, pos, dy, dy1, dy2, S1, S2, dx, dwp, T, D, s_xb, s_xt, s_db, s_dt, NTB,
                     K: tl.constexpr, KP: tl.constexpr, HAS_HIST: tl.constexpr, PACKED: tl.constexpr,
                     SILU: tl.constexpr, L: tl.constexpr, U: tl.constexpr, BD: tl.constexpr, GROUP: tl.constexpr):
    """One program: channels ``o_d`` of the L tokens [a, a + L), walked from the last token down, U
    tokens an iteration (unrolled, so their loads issue together). Each token is one [BD] row and
    the convolution's shifts are register renames: the walk carries the K inputs x[t + 1 - k] and
    the K values dz[t + 1 + i] (with their tokens' positions) that the next token reads, loads
    x[t - K + 1] and dy[t], and forms

        z[t] = Σ_j w[K-1-j] · x[t-j] (taps with pos[t] ≥ j),   dz[t] = dy[t] · act'(z[t])
        dx[t] = Σ_i w[K-1-i] · dz[t+i] (the tokens t + i whose tap i is valid: pos[t+i] ≥ i)
        dw[K-1-j] += dz[t] · x[t-j]

    so every input row is read once (and K - 1 rows more at the program's top end), with no
    scratch and no recomputed halo. dw is this program's partial [BD, K]. With GROUP, dy is that of
    one of three convolutions side by side (:func:`_segment`)."""
    i_d, i_tb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    dyp, Dy, c0 = _segment(dy, dy1, dy2, S1, S2, D, i_d * BD, GROUP)
    o_y = o_d - c0  # the channels in dy's own tensor
    top = i_tb.to(tl.int64) * L + L - 1  # the first token walked
    ws = ()
    for j in tl.static_range(K):
        ws = ws + (_tap_weight(w, x, o_d, m_d, j, K),)
    # the window before the walk: xs[k] = x[top + 1 - k] (k < K), dzs[i] = dz[top + 1 + i] with
    # ps[i] its token's position (i < K; zero past T)
    xs = ()
    for k in tl.static_range(K):
        xs = xs + (_row(x, hist, top + 1 - k, o_d, m_d, b, s_xb, s_xt, T, D, K, HAS_HIST),)
    dzs = ()
    ps = ()
    for i in tl.static_range(K):
        t = top + 1 + i
        p_t = _pos(pos, t, T, K, PACKED)
        win = ()
        for j in tl.static_range(K):
            win = win + (_row(x, hist, t - j, o_d, m_d, b, s_xb, s_xt, T, D, K, HAS_HIST),)
        dzs = dzs + (_dz(win, p_t, ws, dyp, b, t, o_y, m_d, T, Dy, K, SILU),)
        ps = ps + (p_t,)
    dws = ()
    for j in tl.static_range(K):
        dws = dws + (tl.zeros([BD], dtype=tl.float32),)
    # The rows of the first U tokens, then in every iteration those of the next U, requested before
    # this iteration's are used. A load cannot move past an earlier store to dx (which the compiler
    # cannot tell apart from x or dy): loaded where used, each token's loads would wait for the
    # previous token's store, one token's loads in flight (sm_90 SASS: the next U tokens' eight LDGs
    # ahead of this iteration's four STGs; on an H100 at [4, 4096, 1536], one warp, 94.7 µs against
    # 97.6 loaded where used)
    nx, ndy, npos = _walk_rows(x, hist, pos, dyp, top, o_d, o_y, m_d, b, s_xb, s_xt, T, D, Dy, K, HAS_HIST,
                               PACKED, U)
    for it in range(L // U):
        cx, cdy, cpos = nx, ndy, npos
        more = it + 1 < L // U  # (none past the program's tokens)
        nx, ndy, npos = _walk_rows(x, hist, pos, dyp, top - (it + 1) * U, o_d, o_y, m_d & more, b, s_xb,
                                   s_xt, T, D, Dy, K, HAS_HIST, PACKED, U)
        for u in tl.static_range(U):
            t = top - it * U - u
            p, b_new, b_dy = cpos[u], cx[u], cdy[u]
            win = ()  # win[j] = x[t - j]
            for j in tl.static_range(K - 1):
                win = win + (xs[j + 1],)
            win = win + (b_new,)
            dz = _dz_of(win, p, ws, b_dy, K, SILU)
            nd = ()
            for j in tl.static_range(K):
                nd = nd + (dws[j] + tl.where(p >= j, dz * win[j], 0.0),)
            dws = nd
            b_dx = dz * ws[0]
            for i in tl.static_range(1, K):
                b_dx += tl.where(ps[i - 1] >= i, dzs[i - 1], 0.0) * ws[i]
            tl.store(dx + b * s_db + t * s_dt + o_d, b_dx.to(dx.dtype.element_ty), mask=m_d & (t < T))
            xs = win
            n_dz = (dz,)
            n_ps = (p,)
            for i in tl.static_range(K - 1):
                n_dz = n_dz + (dzs[i],)
                n_ps = n_ps + (ps[i],)
            dzs = n_dz
            ps = n_ps
    o_k = tl.arange(0, KP)
    b_dw = tl.zeros([BD, KP], dtype=tl.float32)
    for j in tl.static_range(K):
        b_dw += tl.where(o_k[None, :] == K - 1 - j, dws[j][:, None], 0.0)
    tl.store(dwp + ((b * NTB + i_tb) * D + o_d[:, None]) * K + o_k[None, :], b_dw,
             mask=m_d[:, None] & (o_k[None, :] < K))


def _positions(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """Index of every token within its packed sequence [T] (int32), as :func:`gdn.ops.conv.seq_position`."""
    t = torch.arange(T, device=cu_seqlens.device)
    cu = cu_seqlens.long()
    return (t - cu[torch.bucketize(t, cu[1:], right=True)]).to(torch.int32)


def _blocks(D: int) -> int:
    return min(64 if INTERPRET else OTHER["short_conv"]["BD"], pow2(D, 1))


def _bounds(sizes) -> tuple[int, int, int]:
    """(S1, S2, the largest power of two dividing the inner bounds) of two or three channel segments
    ``sizes`` side by side: segment 1 starts at S1, segment 2 at S2 (their sum with two segments)."""
    S1 = sizes[0]
    S2 = S1 + sizes[1] if len(sizes) == 3 else sum(sizes)
    inner = S1 | (S2 if len(sizes) == 3 else S1)
    return S1, S2, inner & -inner


def _conv_fwd(x, weight, hist, pos, silu: bool, sizes=None):
    """y [B, T, D] in x.dtype; with ``sizes`` (the channel counts of two or three convolutions side by
    side in x and weight), a tuple of y per segment, each its own [B, T, size] tensor."""
    B, T, D = x.shape
    K = weight.shape[1]
    c = OTHER["short_conv"]
    has_hist = hist is not None and K > 1
    BT, BD = c["BT"], _blocks(D)
    if sizes is None:
        ys = (torch.empty(B, T, D, device=x.device, dtype=x.dtype),)
        S1 = S2 = D
    else:
        ys = tuple(torch.empty(B, T, n, device=x.device, dtype=x.dtype) for n in sizes)
        S1, S2, align = _bounds(sizes)
        BD = min(BD, align)
    grid = (cdiv(D, BD), cdiv(T, BT), B)
    direct(_conv_fwd_kernel, grid, x, weight, hist if has_hist else x, pos if pos is not None else x, ys[0],
           ys[1 % len(ys)], ys[-1], S1, S2, T, D, x.stride(0), x.stride(1), K=K, HAS_HIST=has_hist,
           PACKED=pos is not None, SILU=silu, BT=BT, BD=BD, GROUP=sizes is not None, num_warps=c["num_warps"])
    return ys[0] if sizes is None else ys


def _conv_bwd(dy, x, weight, hist, pos, silu: bool, dx=None, sizes=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [B, T, D] in x.dtype, dw [D, K] in fp32) of the convolution given dy; dx written into
    ``dx`` when given (any strides with contiguous channels), else packed. With ``sizes``
    (:func:`_conv_fwd`'s), dy is a tuple of the segments' contiguous gradients."""
    B, T, D = x.shape
    K = weight.shape[1]
    c = OTHER["short_conv"]
    BD, U = min(64 if INTERPRET else c["BD_bwd"], pow2(D, 1)), c["U"]
    if sizes is None:
        dys, (S1, S2) = (dy,), (D, D)
    else:
        dys = dy
        S1, S2, align = _bounds(sizes)
        BD = min(BD, align)
    # tokens a program L: the most (a power of two in [L_min, L_max]) that still leave ``programs``
    # programs a multiprocessor; no more than T needs
    n = B * T * cdiv(D, BD) // (c["programs"] * sm_count(x.device))
    L = min(c["L_max"], max(c["L_min"], 1 << max(0, n.bit_length() - 1)))
    L = max(U, min(L, pow2(T, U)))
    ntb = cdiv(T, L)
    if dx is None:
        dx = torch.empty(B, T, D, device=x.device, dtype=x.dtype)
    dwp = torch.empty(B, ntb, D, K, device=x.device, dtype=torch.float32)
    has_hist = hist is not None and K > 1
    direct(_conv_bwd_kernel, (cdiv(D, BD), ntb, B), x, weight, hist if has_hist else x,
           pos if pos is not None else x, dys[0], dys[1 % len(dys)], dys[-1], S1, S2, dx, dwp, T, D, x.stride(0),
           x.stride(1), dx.stride(0), dx.stride(1), ntb, K=K, KP=pow2(K, 1), HAS_HIST=has_hist,
           PACKED=pos is not None, SILU=silu, L=L, U=U, BD=BD, GROUP=sizes is not None,
           num_warps=c["warps_bwd"])
    return dx, colsum(dwp.view(-1, D * K)).view(D, K)


def _hist_grad(dy, x, weight, hist, silu: bool) -> torch.Tensor:
    """d hist [B, D, K-1]: only the first K-1 outputs read the history; recomputed in fp32 PyTorch."""
    K = weight.shape[1]
    n = min(K - 1, x.shape[1])
    with torch.enable_grad(), torch.autocast(x.device.type, enabled=False):
        h = hist.detach().float().requires_grad_(True)
        xp = torch.cat([h, x[:, :n].float().transpose(1, 2)], dim=-1)  # [B, D, K-1+n]
        w = weight.to(x.dtype).float()
        z = torch.nn.functional.conv1d(xp, w[:, None, :], groups=w.shape[0]).transpose(1, 2)
        out = torch.nn.functional.silu(z) if silu else z
        (dh,) = torch.autograd.grad(out, h, dy[:, :n].float())
    return dh.to(hist.dtype)


class _ShortConvFn(torch.autograd.Function):
    """The Triton convolution of ``n`` inputs (one, or two or three adjacent column blocks of one
    tensor run as one over all their channels: :func:`short_conv_group`), each with its weight; saves
    the input (the joined view), the weight (joined), the history and the packed positions only.
    Each block's dx goes into its joined product's gradient where the block is a split's
    (gdn.ops.joined)."""

    @staticmethod
    def forward(ctx, hist, pos, silu: bool, n: int, *xw):
        xs, ws = xw[:n], xw[n:]
        sizes = [t.shape[2] for t in xs] if n > 1 else None
        x, w = (_adjacent(xs), torch.cat([t.contiguous() for t in ws])) if n > 1 else (xs[0], ws[0])
        ctx.silu, ctx.sizes, ctx.wdt = silu, sizes, [t.dtype for t in ws]
        ctx.slots = [grad_slot(t) for t in xs]
        ctx.save_for_backward(x, w, hist, pos)
        return _conv_fwd(x, w, hist, pos, silu, sizes)

    @staticmethod
    def backward(ctx, *dys):
        x, w, hist, pos = ctx.saved_tensors
        n, need, sizes = len(ctx.slots), ctx.needs_input_grad, ctx.sizes
        dys = tuple(d.contiguous() for d in dys)
        places = [s.take() if s is not None and need[4 + i] else None for i, s in enumerate(ctx.slots)]
        target = _adjacent(places) if all(p is not None for p in places) and x.shape[2] > 1 else None
        dx, dw = _conv_bwd(dys if sizes else dys[0], x, w, hist, pos, ctx.silu, target, sizes)
        dxs = dx.split(sizes, -1) if sizes else (dx,)
        if target is None:  # places not handed out (or not side by side): theirs filled here
            dxs = tuple(d if p is None else p.copy_(d) for d, p in zip(dxs, places))
        dhist = None
        if hist is not None and need[0]:
            dy = dys[0] if n == 1 else torch.cat(dys, -1)
            dhist = _hist_grad(dy, x, w, hist, ctx.silu) if w.shape[1] > 1 else torch.zeros_like(hist)
        dws = dw.split(sizes) if sizes else (dw,)
        return (dhist, None, None, None, *(d if need[4 + i] else None for i, d in enumerate(dxs)),
                *(d.to(dt) if need[4 + n + i] else None for i, (d, dt) in enumerate(zip(dws, ctx.wdt))))


def _packed_positions(cu_seqlens: torch.Tensor, T: int, device) -> torch.Tensor:
    """Each token's index within its packed sequence (made once per offsets tensor)."""
    return offsets.memo(cu_seqlens, ("positions", T, device), lambda: _positions(cu_seqlens.to(device), T))


def short_conv(x: torch.Tensor, weight: torch.Tensor, hist: torch.Tensor | None = None,
               cu_seqlens: torch.Tensor | None = None, activation: str | None = "silu") -> torch.Tensor:
    """Causal depthwise convolution with optional SiLU, differentiable in x, weight and hist.

    Args:
        x: [B, T, D], fp16 / bf16 / fp32.
        weight: [D, K] (any float dtype; rounded to x's dtype, as the PyTorch path does).
        hist: [B, D, K-1], the inputs before x (cast to x's dtype); None means zeros.
        cu_seqlens: [N+1] packed offsets (B == 1, no hist); every sequence starts from zeros.
        activation: ``"silu"`` or None.

    Returns y [B, T, D] in x's dtype. Under autocast on x's device, the unpacked path runs in the
    autocast dtype, like the ``F.conv1d`` it replaces.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a [B, T, D] tensor, got {got}")
    B, T, D = x.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape [D, K] = [{D}, K ≥ 1], got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    K = weight.shape[1]
    dev = x.device.type
    if cu_seqlens is None and torch.is_autocast_enabled(dev):
        x = x.to(torch.get_autocast_dtype(dev))
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    pos = None
    if cu_seqlens is not None:
        if hist is not None:
            raise ValueError("hist cannot be combined with cu_seqlens: packed sequences start from zeros")
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1, got x of shape {tuple(x.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be a 1-D tensor [N+1], got shape {tuple(cu_seqlens.shape)}")
        pos = _packed_positions(cu_seqlens, T, x.device)
    if hist is not None:
        if tuple(hist.shape) != (B, D, K - 1):
            raise ValueError(f"hist must have shape [B, D, K-1] = [{B}, {D}, {K - 1}], got {tuple(hist.shape)}")
        hist = hist.to(x.dtype).contiguous()
    if T < 1:
        raise ValueError(f"x must hold at least one token (T ≥ 1), got shape {tuple(x.shape)}")
    # x is read in place where its channels are contiguous (a column block of a wider product, e.g.
    # the joined input projections of a mixer), its rows and batch rows at their strides
    if x.stride(2) != 1 and D > 1:
        x = x.contiguous()
    return _ShortConvFn.apply(hist, pos, activation == "silu", 1, x, weight.contiguous())


def _adjacent(xs) -> torch.Tensor | None:
    """The [B, T, ΣD] view spanning ``xs`` when they are column blocks side by side in one tensor
    (each block's channels contiguous, the next block starting where this one ends, the same row
    strides: a mixer's q, k, v projections in its joined product), else None."""
    x0 = xs[0]
    if x0.stride(2) != 1:
        return None
    off = x0.storage_offset()
    for t in xs:
        if (t.dim() != 3 or t.shape[:2] != x0.shape[:2] or t.dtype != x0.dtype or t.stride() != x0.stride()
                or t.untyped_storage().data_ptr() != x0.untyped_storage().data_ptr() or t.storage_offset() != off):
            return None
        off += t.shape[2]
    return x0.as_strided((x0.shape[0], x0.shape[1], off - x0.storage_offset()), x0.stride())


def short_conv_group(xs, weights, hist: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                     activation: str | None = "silu") -> tuple[torch.Tensor, ...] | None:
    """:func:`short_conv` of each ``xs[i]`` [B, T, D_i] with ``weights[i]`` [D_i, K] (two or three, one
    kernel size), as one convolution when the inputs are adjacent column blocks of one tensor (a
    mixer's q, k, v in its joined projections) whose bounds the channel blocks can align to; None
    otherwise (the caller runs them one by one). ``hist`` [B, ΣD_i, K-1]: the histories side by side.
    Returns the outputs, each its own [B, T, D_i] tensor in x's dtype."""
    if not 2 <= len(xs) <= 3 or len(weights) != len(xs) or activation not in ("silu", None):
        return None
    x = _adjacent(xs)
    if x is None or x.dtype not in DTYPES or x.shape[1] < 1:
        return None
    B, T, D = x.shape
    dev = x.device.type
    if cu_seqlens is None and torch.is_autocast_enabled(dev) and x.dtype != torch.get_autocast_dtype(dev):
        return None
    K = weights[0].shape[1]
    if any(w.dim() != 2 or w.shape != (t.shape[2], K) for w, t in zip(weights, xs)):
        return None
    if _bounds([t.shape[2] for t in xs])[2] < 16:  # channel blocks this narrow: one by one
        return None
    pos = None
    if cu_seqlens is not None:
        if hist is not None or B != 1:
            return None
        pos = _packed_positions(cu_seqlens, T, x.device)
    if hist is not None:
        if tuple(hist.shape) != (B, D, K - 1):
            return None
        hist = hist.to(x.dtype).contiguous()
    return _ShortConvFn.apply(hist, pos, activation == "silu", len(xs), *xs, *weights)


# ---- one decode step, tails rolled in place -----------------------------------------------------

@triton.jit(do_not_specialize=["s_xb"])
def _conv_step_kernel(x, w, bias, tails, y, s_xb, D, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SILU: tl.constexpr, BD: tl.constexpr):
    """Grid ``(B, cdiv(D, BD))``: BD channels of row b. x[b, d] at ``x + b·s_xb + d`` (a column slice
    of a wider product is read in place); tails [B, D, K-1] contiguous, the K-1 inputs before x,
    rolled by one in place (each program reads and writes only its own channels); y [B, D] packed.
    The taps are summed oldest first in fp32, the order of :func:`gdn.ops.conv.conv_step_`."""
    i_b = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_d = o_d < D
    p_t = tails + (i_b * D + o_d) * (K - 1)
    b_x = tl.load(x + i_b * s_xb + o_d, mask=m_d, other=0.0)
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(K - 1):
        # the history is taken in x's dtype (as the PyTorch step concatenates it with x)
        b_t = tl.load(p_t + j, mask=m_d, other=0.0).to(b_x.dtype)
        acc += b_t.to(tl.float32) * _tap_weight(w, x, o_d, m_d, K - 1 - j, K)
        if j > 0:
            tl.store(p_t + (j - 1), b_t.to(tails.dtype.element_ty), mask=m_d)
    acc += b_x.to(tl.float32) * _tap_weight(w, x, o_d, m_d, 0, K)
    if K > 1:
        tl.store(p_t + (K - 2), b_x.to(tails.dtype.element_ty), mask=m_d)
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(x.dtype.element_ty).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y + i_b * D + o_d, acc.to(y.dtype.element_ty), mask=m_d)


def conv_step_(x: torch.Tensor, weight: torch.Tensor, tails: torch.Tensor, activation: str | None = "silu",
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row in one launch: x [B, 1, D] (any strides; read in place when its last dim
    is contiguous) after the inputs ``tails`` [B, D, K-1] (contiguous; rolled in place to the last
    K-1 inputs, x included); weight [D, K]; bias [D] or None. Returns y [B, 1, D] packed in x.dtype:
    ``act(Σ_j w[:, j]·xp[:, j] + bias)`` over ``xp = [tails, x]`` with the weight and bias rounded
    to x's dtype, the sum and the activation in fp32, y rounded once. Inference only (no autograd)."""
    B, T, D = x.shape
    K = weight.shape[1]
    if T != 1 or tuple(weight.shape) != (D, K) or tuple(tails.shape) != (B, D, K - 1):
        raise ValueError(f"conv_step_ takes x [B, 1, D], weight [D, K], tails [B, D, K-1], got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}, tails {tuple(tails.shape)}")
    if not tails.is_contiguous():
        raise ValueError(f"tails must be contiguous (it is updated in place), got strides {tails.stride()}")
    if x.stride(-1) != 1 and D > 1:
        x = x.contiguous()
    y = torch.empty(B, 1, D, device=x.device, dtype=x.dtype)
    if not B or not D:
        return y
    c = OTHER["conv_step"]
    BD = min(1024 if INTERPRET else c["BD"], pow2(D, 1))
    direct(_conv_step_kernel, (B, cdiv(D, BD)), x, weight.contiguous(), bias if bias is not None else weight, tails, y,
           x.stride(0), D, K=K, HAS_BIAS=bias is not None,
           SILU=activation == "silu", BD=BD, num_warps=c["num_warps"])
    return y
