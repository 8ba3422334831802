"""GPU timing of the model's Triton glue at the 340m training shapes: the causal short convolution
(``gdn.ops.triton.short_conv``) and the RMSNorm / gated RMSNorm passes (``gdn.ops.triton.rmsnorm``)
against the PyTorch Functions of ``gdn.ops.conv`` / ``gdn.ops.norm``.

Shapes: conv [4, 4096, 768] and [4, 4096, 1536] (K = 4, SiLU); RMSNorm [4, 4096, 1024]; gated
RMSNorm [4·4096·6, 256]; bf16. Prints a markdown table of ms (``do_bench`` medians) of the
forward and of forward+backward, Triton against PyTorch. Correctness is ``pytest tests/gpu``
(``tests/gpu/test_glue.py``).

    python benchmarks/glue_gpu.py
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn.ops.conv import ConvActFn, conv_act  # noqa: E402
from gdn.ops.norm import GatedRMSNormFn, RMSNormFn  # noqa: E402
from gdn.ops.triton.rmsnorm import add_rms_norm, gated_rms_norm, rms_norm  # noqa: E402
from gdn.ops.triton.short_conv import short_conv  # noqa: E402

DEV = "cuda"


def bench(fn_fwd, args, dy):
    """(forward ms, forward+backward ms) of ``fn_fwd(*args)``, do_bench medians."""
    from triton.testing import do_bench

    with torch.no_grad():
        t_f = do_bench(lambda: fn_fwd(*args), return_mode="median")
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def step():
        fn_fwd(*args).backward(dy)

    t_fb = do_bench(step, grad_to_none=leaves, return_mode="median")
    return t_f, t_fb


def rows() -> list[str]:
    """One markdown row per pass: Triton and PyTorch, ms forward / forward+backward."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    dt = torch.bfloat16
    out = []

    def row(label, ours, theirs):
        out.append(f"| {label} | {ours[0]:.3f} / {ours[1]:.3f} | {theirs[0]:.3f} / {theirs[1]:.3f} "
                   f"| {theirs[1] / ours[1]:.1f}× |")
        print(out[-1], flush=True)

    for D in (768, 1536):
        x = torch.randn(4, 4096, D, device=DEV, generator=gen).to(dt).requires_grad_()
        w = (torch.randn(D, 4, device=DEV, generator=gen) / 2).requires_grad_()
        dy = torch.randn_like(x)
        h0 = x.new_zeros(4, D, 3)
        row(f"conv [4, 4096, {D}] SiLU", bench(lambda a, b: short_conv(a, b, None, None, "silu"), (x, w), dy),
            bench(lambda a, b: ConvActFn.apply(a, b, h0, None, "silu") if torch.is_grad_enabled()
                  else conv_act(a, b, h0, None, "silu"), (x, w), dy))
    x = torch.randn(4, 4096, 1024, device=DEV, generator=gen).to(dt).requires_grad_()
    w = torch.ones(1024, device=DEV, requires_grad=True)
    dy = torch.randn_like(x)
    row("rmsnorm [4, 4096, 1024]", bench(lambda a, b: rms_norm(a, b, 1e-6), (x, w), dy),
        bench(lambda a, b: RMSNormFn.apply(a, b, 1e-6, dt), (x, w), dy))
    x = torch.randn(4 * 4096 * 6, 256, device=DEV, generator=gen).to(dt).requires_grad_()
    g = torch.randn(4 * 4096 * 6, 256, device=DEV, generator=gen).to(dt).requires_grad_()
    w = torch.ones(256, device=DEV, requires_grad=True)
    dy = torch.randn_like(x)
    row("gated norm [98304, 256]", bench(lambda a, b, c: gated_rms_norm(a, b, c, 1e-6), (x, g, w), dy),
        bench(lambda a, b, c: GatedRMSNormFn.apply(a, b, c, 1e-6), (x, g, w), dy))
    # the training block's residual add and mlp_norm: fp32 stream + bf16 mixer output, normed to bf16,
    # both outputs read downstream; against x + h and then the Triton norm (the block's former path)
    x = torch.randn(4, 4096, 1024, device=DEV, generator=gen).requires_grad_()
    h = torch.randn(4, 4096, 1024, device=DEV, generator=gen).to(dt).requires_grad_()
    w = torch.ones(1024, device=DEV, requires_grad=True)
    ds, dy = torch.randn_like(x), torch.randn_like(h)

    def two_ops(a, b, c):
        s = a + b
        return s, rms_norm(s, c, 1e-6, dt)

    row("add + rmsnorm [4, 4096, 1024] (Triton: one kernel; other: add, then the Triton norm)",
        bench_pair(lambda a, b, c: add_rms_norm(a, b, c, 1e-6, dt), (x, h, w), (ds, dy)),
        bench_pair(two_ops, (x, h, w), (ds, dy)))
    return out


def bench_pair(fn_fwd, args, grads):
    """:func:`bench` of a function with two outputs, each given its gradient."""
    from triton.testing import do_bench

    with torch.no_grad():
        t_f = do_bench(lambda: fn_fwd(*args), return_mode="median")

    def step():
        torch.autograd.backward(fn_fwd(*args), grads)

    t_fb = do_bench(step, grad_to_none=list(args), return_mode="median")
    return t_f, t_fb


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    import triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16", flush=True)
    body = rows()
    print("\n| pass | Triton ms fwd / fwd+bwd | PyTorch ms fwd / fwd+bwd | fwd+bwd speed-up |")
    print("|---|---|---|---|")
    print("\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
