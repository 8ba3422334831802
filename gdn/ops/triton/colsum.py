"""Column sums of a packed [P, D] tensor in fp32: the last step of the glue kernels' parameter
gradients, which a backward leaves as rows of partial sums (one row a program for the norms'
weights and the convolution's taps, one a token for the gate's two parameters).

PyTorch's ``x.sum(0)`` of such a tensor took 11-25 µs a call on an H100 at the shapes of a 340m
training step ([768, 256], [1024, 1024], [16384, 6]; well under a MB each, ≈ 1.7 ms of the step
over 145 calls): few output columns give its reduction few blocks. Here each program owns BD
columns and walks all P rows, BP at a time, into a [BP, BD] fp32 accumulator summed once at the
end; BD is chosen so that the columns spread over the multiprocessors (8 at the least). The order
of the additions is fixed by the shape, so the result is the same at every call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tuning import INTERPRET, cdiv, pow2
from .launch import direct, sm_count


@triton.jit
def _rows_block(x, acc, p0, P, D, o_d, m_d, BP: tl.constexpr):
    o_p = p0 + tl.arange(0, BP)
    m = (o_p < P)[:, None] & m_d[None, :]
    return acc + tl.load(x + o_p.to(tl.int64)[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _colsum_kernel(x, y, P, D, PS, BP: tl.constexpr, BD: tl.constexpr, WHILE: tl.constexpr):
    """y[s, d] = Σ_p x[p, d] in fp32 over rows [s·PS, min(P, (s + 1)·PS)) for this program's BD
    columns and row split s; x packed [P, D], y [splits, D]. ``WHILE``: the row loop as a ``while``
    (Triton 3.6's interpreter cannot run a ``for`` over a run-time bound)."""
    o_d = tl.program_id(0) * BD + tl.arange(0, BD)
    m_d = o_d < D
    s = tl.program_id(1)
    end = tl.minimum(P, (s + 1) * PS)
    acc = tl.zeros([BP, BD], tl.float32)
    if WHILE:
        p0 = s * PS
        while p0 < end:
            acc = _rows_block(x, acc, p0, end, D, o_d, m_d, BP)
            p0 += BP
    else:
        for p0 in range(s * PS, end, BP):
            acc = _rows_block(x, acc, p0, end, D, o_d, m_d, BP)
    tl.store(y + s.to(tl.int64) * D + o_d, tl.sum(acc, 0), mask=m_d)


#: elements of one program's tile (BP × BD): 64 fp32 accumulators a thread at 4 warps
TILE = 8192
#: rows a program walks at the most before the rows are split over programs too (whose [splits, D]
#: sums a second pass adds): a tall input of few columns (the gate's [tokens, heads] at a million
#: tokens) would otherwise sit on a few multiprocessors
ROWS = 32768


def colsum(x: torch.Tensor) -> torch.Tensor:
    """Σ over the rows of ``x`` [P, D] (any float dtype; copied first if not contiguous) as an fp32
    [D] tensor on x's device."""
    if x.dim() != 2:
        raise ValueError(f"colsum: x must be [P, D], got shape {tuple(x.shape)}")
    P, D = x.shape
    x = x.contiguous()
    if D == 0 or P == 0:
        return torch.zeros(D, device=x.device, dtype=torch.float32)
    BD = max(8, min(128, pow2(cdiv(D, sm_count(x.device)), 1)))
    BP = max(16, min(pow2(P, 1), TILE // BD))
    splits = cdiv(P, ROWS)
    PS = cdiv(cdiv(P, splits), BP) * BP  # (a whole number of row blocks a split)
    splits = cdiv(P, PS)
    y = torch.empty(splits, D, device=x.device, dtype=torch.float32)
    direct(_colsum_kernel, (cdiv(D, BD), splits), x, y, P, D, PS, BP=BP, BD=BD, WHILE=INTERPRET, num_warps=4)
    return y[0] if splits == 1 else colsum(y)
