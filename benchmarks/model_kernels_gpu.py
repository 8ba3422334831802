"""GPU check and timing of the model's Triton helper passes that are not recurrence kernels: the
SwiGLU product (``gdn.ops.triton.swiglu``) and the chunked cross entropy's row passes
(``gdn.ops.triton.cross_entropy``), against their PyTorch forms, at the 340m training shapes.

For each pass and dtype (fp32, bf16): relative RMS error of every output against the PyTorch
form computed in float64 on the same inputs, bound 1e-5 (fp32) or 2x the PyTorch form's own error
in that dtype (bf16); then ms of the Triton pass and of the PyTorch form (``do_bench`` medians).
Prints a markdown table; exits non-zero on a failure.

    python benchmarks/model_kernels_gpu.py
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn.ops.triton.cross_entropy import logsumexp_pick, softmax_grad  # noqa: E402
from gdn.ops.triton.swiglu import swiglu_backward, swiglu_forward  # noqa: E402


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def torch_swiglu(g, u, dh):
    h = F.silu(g) * u
    dg = torch.ops.aten.silu_backward(dh * u, g)
    return h, dg, dh * F.silu(g)


def torch_ce(z, t, coef):
    zf = z.float()
    lse = torch.logsumexp(zf, -1)
    picked = zf.gather(1, t[:, None])[:, 0]
    p = torch.exp(zf - lse[:, None])
    p[torch.arange(z.shape[0], device=z.device), t] -= 1.0
    return lse, picked, (p * coef[:, None]).to(z.dtype)


def compare(rows, label, names, ours, theirs, ref, dtype, tol) -> bool:
    """Append one table row per output (error against the fp64 reference, bound: ``tol``, or 2× the
    PyTorch form's own error when ``tol`` is None); True when any output fails."""
    failed = False
    for name, a, b, r in zip(names, ours, theirs, ref):
        bound = tol if tol is not None else 2 * max(rel(b, r), 1e-7)
        err = rel(a, r)
        failed |= not err <= bound
        rows.append(f"| {label} {name} | {dtype} | {err:.1e} | {bound:.1e} | {'ok' if err <= bound else 'FAIL'} |")
    return failed


def main() -> int:
    from triton.testing import do_bench

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, failed = [], False
    for dtype in (torch.float32, torch.bfloat16):
        tol = 1e-5 if dtype == torch.float32 else None
        g = (3 * torch.randn(16384, 2816, device=dev, generator=gen)).to(dtype)
        u = torch.randn(16384, 2816, device=dev, generator=gen).to(dtype)
        dh = torch.randn(16384, 2816, device=dev, generator=gen).to(dtype)
        ref = torch_swiglu(g.double(), u.double(), dh.double())
        ours = (swiglu_forward(g, u), *swiglu_backward(dh, g, u))
        theirs = torch_swiglu(g, u, dh)
        failed |= compare(rows, "swiglu", ("h", "dgate", "dup"), ours, theirs, ref, dtype, tol)
        t_ours = do_bench(lambda: (swiglu_forward(g, u), swiglu_backward(dh, g, u)), return_mode="median")
        t_torch = do_bench(lambda: torch_swiglu(g, u, dh), return_mode="median")
        rows.append(f"| swiglu fwd + bwd ms | {dtype} | triton {t_ours:.3f} | torch {t_torch:.3f} | |")
        del g, u, dh
        z = (4 * torch.randn(1048, 32000, device=dev, generator=gen)).to(dtype)
        t = torch.randint(0, 32000, (1048,), device=dev, generator=gen)
        coef = torch.rand(1048, device=dev, generator=gen) / 16384
        ref = torch_ce(z.double(), t, coef.double())
        lse, picked = logsumexp_pick(z, t)
        ours = (lse, picked, softmax_grad(z, lse, t, coef))
        theirs = torch_ce(z, t, coef)
        failed |= compare(rows, "cross entropy", ("lse", "picked", "dz"), ours, theirs, ref, dtype, tol)
        t_ours = do_bench(lambda: softmax_grad(z, logsumexp_pick(z, t)[0], t, coef), return_mode="median")
        t_torch = do_bench(lambda: torch_ce(z, t, coef), return_mode="median")
        rows.append(f"| cross entropy passes ms (1048 x 32000) | {dtype} | triton {t_ours:.3f} | torch {t_torch:.3f} | |")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| pass | dtype | rel. error (or ms) | bound (or ms) | |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print("SOME CHECKS FAILED" if failed else "ALL OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
