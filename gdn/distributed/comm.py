"""Collectives with a backward, for the context-parallel ops and layers.

Each function here is one collective in the forward and its adjoint in the backward:

- :func:`halo`: the ``n`` tokens before this rank's slice (point-to-point from the previous rank,
  or an all-gather of every rank's last tokens when a slice is shorter than ``n``); the backward
  sends the halo's gradient back to the ranks that own those tokens.
- :func:`all_gather`: every rank's slice (padded to the longest); the backward reduce-scatters.
- :class:`Transfer`: point-to-point sends and receives posted together (the ring of
  :mod:`gdn.distributed.attention`), waited on later so that compute can run meanwhile.

Gloo moves CUDA tensors only in broadcast and all-reduce (torch.distributed's backend table); its
all-gather, reduce-scatter and send/recv take CPU tensors. Under a gloo group every CUDA tensor
therefore passes through host memory here (:func:`_staged`); NCCL and CPU tensors go directly.

Every rank of the group must call them in the same order, in the forward and (when a gradient is
taken on any rank) in the backward: the outputs must need a gradient on every rank or on none.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["halo", "all_gather", "gather_stack", "reduce_scatter_stack", "Transfer"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _staged(x: torch.Tensor, group) -> bool:
    """Whether ``x`` must pass through host memory: a non-CPU tensor under a gloo group (a mixed
    ``cpu:gloo,cuda:nccl`` default group sends CUDA tensors through NCCL and reports another name)."""
    return x.device.type != "cpu" and dist.get_backend(group) == "gloo"


def gather_stack(x: torch.Tensor, group) -> torch.Tensor:
    """[size, *x.shape]: every rank's ``x`` (same shape everywhere), in rank order."""
    size = dist.get_world_size(group)
    x = x.reshape(1, *x.shape) if x.dim() == 0 else x
    src = x.cpu() if _staged(x, group) else x
    out = src.new_empty((size * x.shape[0], *x.shape[1:]))  # the concatenated form: gloo takes no other
    _all_gather_single(out, src.contiguous(), group=group)
    return out.to(x.device).view(size, *x.shape)


def reduce_scatter_stack(x: torch.Tensor, group) -> torch.Tensor:
    """``Σ_ranks x[rank]`` for this rank, from x [size, ...] on every rank (the adjoint of :func:`gather_stack`)."""
    src = x.cpu() if _staged(x, group) else x
    out = src.new_empty(x.shape[1:])
    flat = src.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    _reduce_scatter_single(out, flat.contiguous(), group=group)
    return out.to(x.device)


class Transfer:
    """Sends and receives between ranks of ``group``, posted together in one ``batch_isend_irecv``.

    ``sends``: ``(tensor, group rank, tag)``; ``recvs``: ``(shape, dtype, group rank, tag)``, received
    on ``device``. :meth:`wait` blocks until every one has completed and returns the received
    tensors in the order of ``recvs``. Tags tell apart several messages between the same two ranks
    in one batch (NCCL ignores them and matches in posting order, which both sides share). Every
    receive must be matched by a send that the peer posts in the same round of its own schedule.
    """

    def __init__(self, sends, recvs, group, device):
        self.device, self.sent, self.recvs = device, [], []
        ops = []
        for x, peer, tag in sends:
            x = x.cpu() if _staged(x, group) else x.contiguous()
            self.sent.append(x)  # alive until the wait (a staged host copy has no other owner)
            ops.append(dist.P2POp(dist.isend, x, dist.get_global_rank(group, peer), group, tag))
        staged = device.type != "cpu" and dist.get_backend(group) == "gloo"
        for shape, dtype, peer, tag in recvs:
            buf = torch.empty(shape, dtype=dtype, device="cpu" if staged else device)
            self.recvs.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, peer), group, tag))
        self.works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.works, self.sent = [], None
        return [buf.to(self.device) for buf in self.recvs]


def _exchange(send: torch.Tensor | None, to: int | None, recv: torch.Tensor | None, frm: int | None, group) -> None:
    """Send ``send`` to group rank ``to`` and receive into ``recv`` from group rank ``frm`` (either may be None)."""
    sends = [] if send is None else [(send, to, 0)]
    recvs = [] if recv is None else [(recv.shape, recv.dtype, frm, 0)]
    device = recv.device if recv is not None else send.device
    got = Transfer(sends, recvs, group, device).wait()
    if recv is not None:
        recv.copy_(got[0])


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, cp):
        ctx.cp, ctx.n, ctx.T = cp, n, x.shape[1]
        r, W, group = cp.rank, cp.size, cp.group
        shape = (x.shape[0], n, *x.shape[2:])
        if n <= cp.min_length:  # one hop: the previous rank holds all n tokens
            ctx.hop = True
            out = x.new_zeros(shape)
            _exchange(x[:, x.shape[1] - n:] if r < W - 1 else None, r + 1, out if r > 0 else None, r - 1, group)
            return out
        # some slice is shorter than n: every rank's last min(n, length) tokens, right-aligned in n slots
        ctx.hop = False
        tail = x.new_zeros(shape)
        m = min(n, x.shape[1])
        tail[:, n - m:] = x[:, x.shape[1] - m:]
        tails = gather_stack(tail, group)  # [W, B, n, ...]
        parts = [tails[j][:, n - min(n, cp.bounds[j + 1] - cp.bounds[j]):] for j in range(r)]
        got = torch.cat(parts, 1)[:, -n:] if parts else x.new_zeros((x.shape[0], 0, *x.shape[2:]))
        out = x.new_zeros(shape)
        out[:, n - got.shape[1]:] = got
        return out

    @staticmethod
    def backward(ctx, g):
        cp, n, T = ctx.cp, ctx.n, ctx.T
        r, W, group = cp.rank, cp.size, cp.group
        dx = g.new_zeros((g.shape[0], T, *g.shape[2:]))
        if ctx.hop:
            back = g.new_empty(g.shape) if r < W - 1 else None
            _exchange(g if r > 0 else None, r - 1, back, r + 1, group)
            if back is not None:
                dx[:, T - n:] += back
            return dx, None, None
        # adjoint of the all-gather path: scatter g over the tails it read, reduce-scatter, keep ours
        dtails = g.new_zeros((W, *g.shape))
        need = n  # halo slots still to fill, walking back from rank r − 1
        for j in range(r - 1, -1, -1):
            if need == 0:
                break
            m = min(n, cp.bounds[j + 1] - cp.bounds[j], need)
            dtails[j][:, n - m:] = g[:, need - m:need]
            need -= m
        mine = reduce_scatter_stack(dtails, group)
        m = min(n, T)
        dx[:, T - m:] += mine[:, n - m:]
        return dx, None, None


def halo(x: torch.Tensor, n: int, cp) -> torch.Tensor:
    """The ``n`` tokens before this rank's slice: x [B, T, ...] (this rank's slice) -> [B, n, ...];
    zeros before global position 0. ``cp``: a :class:`gdn.distributed.ContextParallel`."""
    if n < 1:
        return x.new_zeros((x.shape[0], 0, *x.shape[2:]))
    return _Halo.apply(x, n, cp)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp, ctx.T = cp, x.shape[1]
        longest = max(b - a for a, b in zip(cp.bounds[:-1], cp.bounds[1:]))
        pad = x.new_zeros((x.shape[0], longest, *x.shape[2:]))
        pad[:, : x.shape[1]] = x
        return gather_stack(pad, cp.group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_stack(g, ctx.cp.group)[:, : ctx.T], None


def all_gather(x: torch.Tensor, cp, upto: int | None = None) -> torch.Tensor:
    """The global sequence [B, total, ...] (or its first ``upto`` ranks' tokens) from every rank's
    slice x [B, T_r, ...]; the gradient of each slice returns to its rank."""
    stacked = _AllGather.apply(x, cp)  # [W, B, longest, ...]
    ranks = cp.size if upto is None else upto
    return torch.cat([stacked[j][:, : cp.bounds[j + 1] - cp.bounds[j]] for j in range(ranks)], 1)
