"""GPU timing of the model's Triton helper passes that are not recurrence kernels, at the 340m
training shapes: the SwiGLU product (``gdn.ops.triton.swiglu``, [16384, 2816]) and the chunked
cross entropy's row passes (``gdn.ops.triton.cross_entropy``, 1048 rows × 32000 words), against
their PyTorch forms.

Prints a markdown table of ms (``do_bench`` medians) per pass and dtype (fp32, bf16). Correctness
is ``pytest tests/gpu`` (``tests/gpu/test_glue.py``).

    python benchmarks/model_kernels_gpu.py
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn.ops.triton.cross_entropy import logsumexp_pick, softmax_grad  # noqa: E402
from gdn.ops.triton.swiglu import swiglu_backward, swiglu_forward  # noqa: E402


def torch_swiglu(g, u, dh):
    """SiLU(g)·u and its gradients (dg, du) for cotangent dh, as PyTorch computes them."""
    h = F.silu(g) * u
    dg = torch.ops.aten.silu_backward(dh * u, g)
    return h, dg, dh * F.silu(g)


def torch_ce(z, t, coef):
    """Per row: logsumexp, the target's logit and coef·(softmax − onehot), as PyTorch computes them."""
    zf = z.float()
    lse = torch.logsumexp(zf, -1)
    picked = zf.gather(1, t[:, None])[:, 0]
    p = torch.exp(zf - lse[:, None])
    p[torch.arange(z.shape[0], device=z.device), t] -= 1.0
    return lse, picked, (p * coef[:, None]).to(z.dtype)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    from triton.testing import do_bench

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        g = (3 * torch.randn(16384, 2816, device=dev, generator=gen)).to(dtype)
        u = torch.randn(16384, 2816, device=dev, generator=gen).to(dtype)
        dh = torch.randn(16384, 2816, device=dev, generator=gen).to(dtype)
        t_ours = do_bench(lambda: (swiglu_forward(g, u), swiglu_backward(dh, g, u)), return_mode="median")
        t_torch = do_bench(lambda: torch_swiglu(g, u, dh), return_mode="median")
        rows.append(f"| swiglu fwd + bwd (16384 × 2816) | {name} | {t_ours:.3f} | {t_torch:.3f} "
                    f"| {t_torch / t_ours:.1f}× |")
        del g, u, dh
        z = (4 * torch.randn(1048, 32000, device=dev, generator=gen)).to(dtype)
        t = torch.randint(0, 32000, (1048,), device=dev, generator=gen)
        coef = torch.rand(1048, device=dev, generator=gen) / 16384
        t_ours = do_bench(lambda: softmax_grad(z, logsumexp_pick(z, t)[0], t, coef), return_mode="median")
        t_torch = do_bench(lambda: torch_ce(z, t, coef), return_mode="median")
        rows.append(f"| cross entropy passes (1048 × 32000) | {name} | {t_ours:.3f} | {t_torch:.3f} "
                    f"| {t_torch / t_ours:.1f}× |")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| pass | dtype | Triton ms | PyTorch ms | speed-up |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
