"""Kimi Delta Attention's Triton kernels on the GPU against float64 references.

- Chunk kernels (:func:`gdn.ops.kda.triton.chunk.chunk_kda`), tier 3 (see :mod:`tests.gpu.helpers`):
  awkward shapes (K = 100, K = V = 60 and V = 16, padded inside; grouped heads; packed sequences
  with empty and one-token members; a strong per-channel decay of up to 5 nats a token) and two
  benchmark shapes, fp32, bf16 and fp16, with an initial state and the final state: o, the final state
  and every gradient (q, k, v, g, β, initial state) against the float64 PyTorch chunk form on the
  fp32 inputs as drawn. Half-precision runs round q, k, v only (g, β and the state stay fp32).
- The public op (``backend="triton"``, with gradients: the chunk kernels), the token-recurrent
  kernels and the PyTorch chunk form at four more shapes (T = 1 and 777, K = 256, V = 100) with
  every input but the state rounded in bf16 runs, to fixed bounds: relative error ≤ 1e-4 in fp32
  and ≤ 5e-2 in bf16.
- Token-recurrent kernels (:func:`gdn.ops.kda.triton.recurrent.recurrent_kda`, the op's decode path
  and its path for V above the chunk kernels' limit), forward alone and with their backward, tier 3.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from gdn import ops
from gdn.ops.kda import chunk as chunk_form
from gdn.ops.kda import reference
from gdn.ops.kda.triton.chunk import chunk_kda
from gdn.ops.kda.triton.recurrent import recurrent_kda
from gdn.ops.tuning import MAX_HEAD_DIM

from .helpers import (DEVICE, assert_within, dtype_id, leaves, offsets, one_large_case_at_a_time,
                      outputs_and_grads, rel_err, tier3_bounds)

DTYPES = (torch.float32, torch.bfloat16)
#: the chunk kernels' cases run fp16 as well (its dot operands overflow past e^11: kkt's own bound)
CHUNK_DTYPES = DTYPES + (torch.float16,)
#: (name, B, T, H, HV, K, V, packed lengths or None, g scale or None). g is logsigmoid(x + 3), or
#: with a scale s, −s·uniform(0, 1) (strong decay).
CHECKS = [
    ("T=130, K=100, V=128, HV=2H", 1, 130, 2, 4, 100, 128, None, None),
    ("packed [1, 200, 64, 0, 135], HV=2H", 1, 400, 2, 4, 128, 128, (1, 200, 64, 0, 135), None),
    ("strong decay (g ≥ −5), T=256", 2, 256, 1, 2, 128, 128, None, 5.0),  # ~160 nats per chunk
    ("(8, 2048, 16, 128)", 8, 2048, 16, 16, 128, 128, None, None),
    ("(1, 8192, H=16, HV=32, 128)", 1, 8192, 16, 32, 128, 128, None, None),
    ("T=63, K=60, V=60, B=2", 2, 63, 1, 2, 60, 60, None, None),
    ("T=63, K=60, V=16, B=2", 2, 63, 1, 2, 60, 16, None, None),  # V padded to the 32-wide tiles
]
#: g, β and the state stay fp32 in the half-precision runs of the chunk-kernel cases.
WIDE = ("g", "beta", "initial_state")


def _call(fn, cu):
    def call(xs):
        return fn(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], initial_state=xs["initial_state"],
                  output_final_state=True, cu_seqlens=cu)
    return call


def draw(B, T, H, HV, K, V, lens, g_scale, seed, device=DEVICE):
    """fp64 copies of fp32 draws made on the CPU (so every device sees the same numbers), offsets
    (CPU) or None, and the cotangents of o and of the final state."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen)

    N = len(lens) if lens else B
    g = F.logsigmoid(r(B, T, HV, K) + 3) if g_scale is None else -g_scale * torch.rand(B, T, HV, K, generator=gen)
    d = dict(q=r(B, T, H, K), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, HV, V), g=g,
             beta=torch.sigmoid(r(B, T, HV)), initial_state=r(N, HV, K, V) * 0.3)
    d = {n: x.to(device, torch.float64) for n, x in d.items()}
    do, dS = r(B, T, HV, V).to(device, torch.float64), r(N, HV, K, V).to(device, torch.float64)
    return d, (offsets(lens) if lens else None), do, dS


@functools.lru_cache(maxsize=1)
def reference_case(spec, seed, device=DEVICE):
    """Inputs and the float64 chunk-form results of one case, kept for the case's next dtype (the
    tests run the dtypes of a case one after the other and clear this after the last)."""
    _, B, T, H, HV, K, V, lens, g_scale = spec
    d, cu, do, dS = draw(B, T, H, HV, K, V, lens, g_scale, seed, device)
    ref = outputs_and_grads(_call(chunk_form.kimi_delta_attention, cu), leaves(d, torch.float64, WIDE), do, dS)
    return d, cu, do, dS, ref


def check_chunk_case(spec, seed, dtype, *, device=DEVICE, kernel=chunk_kda):
    """Errors of ``kernel`` at one case and dtype against the float64 chunk form, and their bounds
    (the two benchmark shapes one at a time across workers: their references take 30-40 GiB)."""
    _, B, T, H, HV, K, V, *_ = spec
    with one_large_case_at_a_time(B * T * HV * K * V):
        d, cu, do, dS, ref = reference_case(spec, seed, device)
        got = outputs_and_grads(_call(kernel, cu), leaves(d, dtype, WIDE), do, dS)
        errs = {n: rel_err(got[n], ref[n]) for n in ref}
        base = None
        if dtype not in (torch.float32, torch.float64):
            chunk = outputs_and_grads(_call(chunk_form.kimi_delta_attention, cu), leaves(d, dtype, WIDE), do, dS)
            base = {n: rel_err(chunk[n], ref[n]) for n in ref}
    return errs, tier3_bounds(dtype, ref, base)


@pytest.mark.parametrize("dtype", CHUNK_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec,seed", [pytest.param(c, 100 + i, id=c[0]) for i, c in enumerate(CHECKS)])
def test_chunk_kernels(spec, seed, dtype):
    try:
        errs, bounds = check_chunk_case(spec, seed, dtype)
    finally:
        if dtype == CHUNK_DTYPES[-1]:  # the case's last run: free its cached reference
            reference_case.cache_clear()
    assert_within(errs, bounds, f"chunk_kda at {spec[0]}, {dtype_id(dtype)}")


@pytest.mark.parametrize("dtype", CHUNK_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec,seed", [pytest.param(c, 100 + i, id=c[0]) for i, c in enumerate(CHECKS)
                                       if c[0].startswith(("packed", "T=130", "(8, 2048"))])
def test_chunk_kernels_state_reads_by_pointer(spec, seed, dtype, monkeypatch):
    """The forward state pass's other form (``KDA["state_fwd"]["TMA"]`` off: W, KT and U read
    through pointers, as on cards without tensor descriptors; the default reads them through
    descriptors) at the packed case (an empty sequence's final state, a one-token sequence), an
    unpadded K and a benchmark shape."""
    from gdn.ops import tuning

    monkeypatch.setitem(tuning.KDA, "state_fwd", dict(tuning.KDA["state_fwd"], TMA=False))
    try:
        errs, bounds = check_chunk_case(spec, seed, dtype)
    finally:
        if dtype == CHUNK_DTYPES[-1]:
            reference_case.cache_clear()
    assert_within(errs, bounds, f"chunk_kda (state reads by pointer) at {spec[0]}, {dtype_id(dtype)}")


# ------------------------------------------------------------------ public op and chunk form, fixed bounds
OP_SHAPES = [(2, 300, 2, 4, 128, 128), (1, 777, 4, 8, 64, 100), (3, 1, 2, 4, 128, 128), (1, 200, 1, 2, 256, 128)]
OP_BOUND = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


@functools.lru_cache(maxsize=1)
def op_reference(shape, device=DEVICE):
    """fp32 draws (a uniform decay in [−0.5, 0], unit keys, an initial state of unit entries), the
    cotangents and the float64 chunk form's results."""
    B, T, H, HV, K, V = shape
    gen = torch.Generator(device=device).manual_seed(sum(shape))

    def r(*s):
        return torch.randn(*s, generator=gen, device=device)

    d = dict(q=r(B, T, H, K), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, HV, V),
             g=-torch.rand(B, T, HV, K, generator=gen, device=device) * 0.5,
             beta=torch.rand(B, T, HV, generator=gen, device=device), initial_state=r(B, HV, K, V))
    do, dS = r(B, T, HV, V).double(), r(B, HV, K, V).double()
    ref = outputs_and_grads(_call(chunk_form.kimi_delta_attention, None), leaves(d, torch.float64), do, dS)
    return d, do, dS, ref


def check_op_shape(shape, dtype, *, device=DEVICE, backend="triton"):
    """{"op": errors, "recurrent": errors, "chunk form": errors} of the public op on ``backend``, of
    the token-recurrent kernels and of the PyTorch chunk form, every input but the initial state in
    ``dtype``."""
    d, do, dS, ref = op_reference(shape, device)
    op = functools.partial(ops.kimi_delta_attention, backend=backend)
    out = {}
    for name, fn in (("op", op), ("recurrent", recurrent_kda), ("chunk form", chunk_form.kimi_delta_attention)):
        got = outputs_and_grads(_call(fn, None), leaves(d, dtype), do, dS)
        out[name] = {n: rel_err(got[n], ref[n]) for n in ref}
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", OP_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_op_and_chunk_form(shape, dtype):
    try:
        results = check_op_shape(shape, dtype)
    finally:
        if dtype == DTYPES[-1]:
            op_reference.cache_clear()
    for name, errs in results.items():
        assert_within(errs, dict.fromkeys(errs, OP_BOUND[dtype]), f"{name} {shape} {dtype_id(dtype)}")


# ---------------------------------------------------------------------------- token-recurrent kernels
#: (name, B, T, H, HV, K, V, packed lengths or None, with gradients?)
RECURRENT = [
    ("decode B=3", 3, 1, 2, 4, 128, 128, None, False),
    ("decode packed 4", 1, 4, 2, 4, 100, 60, (1, 1, 1, 1), False),
    ("prefill T=40", 2, 40, 1, 2, 128, 128, None, False),
    ("packed [1, 0, 30, 17] with grads", 1, 48, 2, 4, 64, 100, (1, 0, 30, 17), True),
    ("T=70 K=256 with grads", 1, 70, 1, 2, 256, 64, None, True),
    (f"V={2 * MAX_HEAD_DIM} with grads", 1, 50, 1, 1, 64, 2 * MAX_HEAD_DIM, None, True),
]


def check_recurrent_case(spec, dtype, *, device=DEVICE, kernel=recurrent_kda):
    """Errors of ``kernel`` (forward alone, or forward and backward) against the float64
    reference recurrence, and their tier-3 bounds (bf16: twice the chunk form's errors)."""
    _, B, T, H, HV, K, V, lens, grad = spec
    d, cu, do, dS = draw(B, T, H, HV, K, V, lens, None, seed=B * T + K + V, device=device)

    def run(fn, dt):
        xs = leaves(d, dt, WIDE)
        if grad:
            return outputs_and_grads(_call(fn, cu), xs, do, dS)
        with torch.no_grad():
            o, S = _call(fn, cu)(xs)
        return {"o": o, "S": S}

    ref = run(reference.kimi_delta_attention, torch.float64)
    got = run(kernel, dtype)
    errs = {n: rel_err(got[n], ref[n]) for n in ref}
    base = None
    if dtype not in (torch.float32, torch.float64):
        chunk = run(chunk_form.kimi_delta_attention, dtype)
        base = {n: rel_err(chunk[n], ref[n]) for n in ref}
    return errs, tier3_bounds(dtype, ref, base)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", [pytest.param(c, id=c[0]) for c in RECURRENT])
def test_recurrent_kernels(spec, dtype):
    errs, bounds = check_recurrent_case(spec, dtype)
    assert_within(errs, bounds, f"recurrent_kda at {spec[0]}, {dtype_id(dtype)}")


def test_op_routes_wide_values_to_the_recurrent_kernels(device=DEVICE):
    """V above the chunk kernels' limit runs the token-recurrent kernels (which have a backward)
    through the public op, at any length: its output is theirs, bit for bit."""
    d, _, _, _ = draw(1, 130, 1, 1, 64, 2 * MAX_HEAD_DIM, None, None, seed=3, device=device)
    xs = leaves(d, torch.float32, WIDE)
    o, _ = ops.kimi_delta_attention(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], backend="triton")
    o_k, _ = recurrent_kda(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"])
    assert torch.equal(o, o_k)
