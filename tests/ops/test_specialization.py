"""A new sequence length compiles nothing: every chunk-kernel launch of a forward + backward has the
same compiled-kernel key at every T (same batch, heads, dims, dtype and options).

Triton compiles one kernel per key: the constexpr values and, for each run-time argument, what it
specialises on (an int's value being 1 or a multiple of 16, a pointer's 16-byte alignment, the
dtype). The key is computed here by Triton's own specialisation function on the launches that
:func:`gdn.ops.triton.launch.recording` collects (nothing runs), so an int argument that follows T
without ``do_not_specialize``, or a tile or pass choice that follows T, fails this test on the CPU.
"""
from __future__ import annotations

import inspect
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from gdn.ops.tuning import INTERPRET  # noqa: E402

if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("triton was imported before TRITON_INTERPRET was set in this process", allow_module_level=True)

from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

from gdn.ops.delta.triton.chunk import chunk_op  # noqa: E402
from gdn.ops.kda.triton.chunk import chunk_kda  # noqa: E402
from gdn.ops.triton import launch as L  # noqa: E402


def compile_key(kernel, args, meta) -> tuple:
    """What Triton keys a compiled kernel on, for one recorded launch (interpreter kernels carry
    their ``triton.jit`` keywords in ``.kwargs``)."""
    sig = inspect.signature(kernel.fn)
    bound = sig.bind_partial(*args, **{k: v for k, v in meta.items() if k in sig.parameters})
    fixed = set(kernel.kwargs.get("do_not_specialize") or ())
    key = []
    for name, value in bound.arguments.items():
        if sig.parameters[name].annotation in ("tl.constexpr", "constexpr"):
            key.append((name, "constexpr", repr(value)))
        else:
            key.append((name,) + tuple(native_specialize_impl(BaseBackend, value, False, name not in fixed, True)))
    options = tuple(sorted((k, repr(v)) for k, v in meta.items() if k not in sig.parameters))
    return kernel.fn.__name__, tuple(key), options


def launches(op, T: int, per_channel: bool) -> list:
    """The compile keys of one forward + backward of ``op`` at length T (B = 2, H = 2, HV = 4,
    K = V = 32, fp16, gate, β, initial and final state)."""
    g = torch.Generator().manual_seed(T)
    B, H, HV, D = 2, 2, 4, 32
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float16, requires_grad=True)
    k = torch.randn(B, T, H, D, generator=g, dtype=torch.float16, requires_grad=True)
    v = torch.randn(B, T, HV, D, generator=g, dtype=torch.float16, requires_grad=True)
    gate = -torch.rand(B, T, HV, *((D,) if per_channel else ()), generator=g).requires_grad_()
    beta = torch.rand(B, T, HV, generator=g).requires_grad_()
    h0 = torch.randn(B, HV, D, D, generator=g).requires_grad_()
    with L.recording() as rec:
        o, ht = op(q, k, v, gate, beta, initial_state=h0, output_final_state=True)
        (o.float().sum() + ht.sum()).backward()
    return [compile_key(kernel, args, meta) for kernel, _, args, meta in rec]


@pytest.mark.parametrize("op,per_channel", [(chunk_op, False), (chunk_kda, True)], ids=["gated_delta_rule", "kda"])
def test_new_length_compiles_nothing(op, per_channel):
    base = launches(op, 64, per_channel)
    assert len(base) >= 4  # a forward and a backward were recorded
    for T in (1, 63, 100, 257):
        other = launches(op, T, per_channel)
        assert [k[0] for k in other] == [k[0] for k in base], T
        for a, b in zip(other, base):
            assert a == b, (T, a[0], [(x, y) for x, y in zip(a[1], b[1]) if x != y] or (a[2], b[2]))
