"""Shared pieces of the GPU tests: tier-3 bounds (docs/DESIGN.md §6), leaves in the dtypes a check
runs, the outputs and gradients of one call, and a failure message that shows every error.

Tier 3: errors are relative RMS errors ``‖x − ref‖ / ‖ref‖`` (:func:`rel_err`) against a float64
reference computed from the fp32 inputs as drawn. fp32 runs must stay within :data:`FP32_TOL`;
half-precision runs (bf16, and fp16 where the interpreter stands in for a GPU) within twice the
error the PyTorch chunk form makes from the same rounded inputs, which is what the rounding
costs anyway and leaves room for half-precision intermediates.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile

import torch

from tests.ops.helpers import HAS_BETA, HAS_G, rel_err

__all__ = ["DEVICE", "FP32_TOL", "HAS_BETA", "HAS_G", "rel_err", "tier3_bounds", "assert_within", "leaves",
           "grad_name", "outputs_and_grads", "offsets", "dtype_id", "one_large_case_at_a_time"]

#: Where the tests run. A dry run of a test's logic on the CPU (Triton's interpreter) passes its
#: own device to the check functions, which all take ``device``.
DEVICE = "cuda"
#: Tier-3 bound for fp32 inputs (and for states, which are fp32 arithmetic whatever the inputs).
FP32_TOL = 2e-3


#: Elements of the largest per-token state product (B · T · HV · K · V) a case may have and still run
#: beside other workers' cases: the float64 references of larger ones take tens of GiB of the card.
LARGE_CASE = 2 ** 30


@contextlib.contextmanager
def one_large_case_at_a_time(size: int):
    """Hold, for a case whose float64 reference is large (``size`` > :data:`LARGE_CASE`), a lock
    that every pytest worker on this machine shares, so that several workers on one GPU do not run
    such cases at once and run each other out of memory; smaller cases run without it."""
    if size <= LARGE_CASE:
        yield
        return
    path = os.path.join(tempfile.gettempdir(), f"gdn-gpu-large-case-{os.getuid()}.lock")
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:  # the case's cached blocks go back to the device before the next worker's case
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            fcntl.flock(f, fcntl.LOCK_UN)


def dtype_id(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (test ids and messages)."""
    return str(dtype).replace("torch.", "")


def tier3_bounds(dtype: torch.dtype, keys, baseline: dict | None = None) -> dict:
    """Bound per key: :data:`FP32_TOL` for fp32/fp64 runs, ``2 × baseline[key]`` for half dtypes
    (``baseline``: the PyTorch chunk form's errors on the same half-precision inputs)."""
    if dtype in (torch.float32, torch.float64):
        return {k: FP32_TOL for k in keys}
    return {k: 2 * baseline[k] for k in keys}


def assert_within(errs: dict, bounds: dict, what: str) -> None:
    """Assert ``errs[k] <= bounds[k]`` for every key (a NaN error fails); the message lists all of
    them, worst first, so one failure shows the whole case."""
    bad = [k for k in errs if not errs[k] <= bounds[k]]
    order = sorted(errs, key=lambda k: -(errs[k] / max(bounds[k], 1e-30)) if errs[k] == errs[k] else -float("inf"))
    table = ", ".join(f"{k} {errs[k]:.2e} (≤ {bounds[k]:.1e})" for k in order)
    assert not bad, f"{what}: {', '.join(bad)} over the bound; {table}"


def leaves(d: dict, dtype: torch.dtype, wide=("initial_state",)) -> dict:
    """Fresh leaf copies of the tensors of ``d`` that require grad: in ``dtype``, except the names in
    ``wide``, which are fp32 (fp64 when ``dtype`` is fp64). None entries stay None."""
    w = torch.float64 if dtype == torch.float64 else torch.float32
    return {n: None if x is None else x.detach().to(w if n in wide else dtype).clone().requires_grad_(True)
            for n, x in d.items()}


def grad_name(name: str) -> str:
    """The key of an input's gradient: ``dq``, ``dbeta``, ... and ``dh0`` for the initial state."""
    return "dh0" if name == "initial_state" else "d" + name


def outputs_and_grads(call, xs: dict, do: torch.Tensor, dS: torch.Tensor) -> dict:
    """``call(xs) -> (o, S)``, then the backward of ``Σ o·do + Σ S·dS`` (in fp64): ``{"o", "S",
    "dq", ...}`` with a gradient for every leaf of ``xs`` (reaching it both through o and through S)."""
    o, S = call(xs)
    ((o.double() * do).sum() + (S.double() * dS).sum()).backward()
    out = {"o": o.detach(), "S": S.detach()}
    out.update({grad_name(n): x.grad for n, x in xs.items() if x is not None})
    return out


def offsets(lens, device="cpu") -> torch.Tensor:
    """Packed-sequence offsets ``[0, l0, l0 + l1, ...]`` (int32) for sequence lengths ``lens``."""
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def launched(monkeypatch, *modules) -> list:
    """The names of the kernels launched from here on through ``modules``' ``launch`` (each module's
    name for gdn.ops.triton.launch.launch), each still launched."""
    seen = []
    run = modules[0].launch

    def spy(kernel, grid, *args, **meta):
        seen.append(kernel.fn.__name__)
        return run(kernel, grid, *args, **meta)

    for m in modules:
        monkeypatch.setattr(m, "launch", spy)
    return seen


def poison_empty(monkeypatch) -> None:
    """From here on ``torch.empty`` fills floating-point tensors with NaN: a kernel that reads rows
    nobody wrote (and drops them by multiplying with zero) then gives NaN instead of passing on
    whatever finite values fresh memory happened to hold."""
    real = torch.empty

    def empty(*args, **kw):
        t = real(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
