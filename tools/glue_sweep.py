"""The training step's largest glue kernels timed alone over launch settings (CUDA).

At the 340m model's layouts: the short convolution's backward and forward with x a column block of
the joined input product (q and k: 768 channels, v: 1536; dx written into the product's gradient
at its strides), the residual add + RMSNorm's backward ([16384, 1024], fp32 stream) and the gated
RMSNorm's backward ([98304, 256]). Each setting's gradients are checked against the defaults' (the
relative error is printed), then timed (``triton.testing.do_bench`` medians, µs) beside the pass's
byte floor at the card's copy bandwidth (``--bandwidth``, GB/s).

    python tools/glue_sweep.py [--bandwidth 3350] [--top 8]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn.ops import tuning  # noqa: E402
from gdn.ops.triton import rmsnorm as rn  # noqa: E402
from gdn.ops.triton import short_conv as sc  # noqa: E402

B, T = 4, 4096
WIDTH = 768 * 2 + 1536 * 2 + 16  # the joined product: q, k, v, g, then a and b padded to 8


def _us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median") * 1e3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def sweep(table: str, grid: dict, run, check) -> list:
    """[(µs, setting, error)] of ``run()`` at each setting of ``grid`` ({key: values}) of
    ``tuning.OTHER[table]``, fastest first; ``check(out)`` gives an output's error against the
    defaults'. The table is restored after."""
    base = dict(tuning.OTHER[table])
    rows = []
    try:
        for values in itertools.product(*grid.values()):
            setting = dict(zip(grid, values))
            tuning.OTHER[table].update(setting)
            try:
                err = check(run())
                rows.append((_us(run), setting, err))
            except Exception as e:  # a setting the compiler refuses (registers, shared memory)
                print(f"  {setting}: {type(e).__name__}: {str(e)[:120]}")
    finally:  # (each setting sets every key of the grid: only the defaults need restoring)
        tuning.OTHER[table].clear()
        tuning.OTHER[table].update(base)
    return sorted(rows, key=lambda r: r[0])


def report(label: str, floor: float, default: float, rows: list, top: int) -> None:
    print(f"{label}: byte floor {floor:.1f} µs, defaults {default:.1f} µs")
    for us, setting, err in rows[:top]:
        print(f"  {us:7.1f} µs  {setting}  rel. error {err:.1e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bandwidth", type=float, default=0.0, help="copy GB/s for the floors (0: 3350 on an H100, "
                   "4200 otherwise)")
    p.add_argument("--top", type=int, default=8, help="settings printed a pass")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA")
    import triton

    dev = "cuda"
    name = torch.cuda.get_device_name()
    bw = (a.bandwidth or (3350.0 if "H100" in name else 4200.0)) * 1e9
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}, bf16; floors at {bw / 1e9:.0f} GB/s")
    gen = torch.Generator(device=dev).manual_seed(0)
    proj = torch.randn(B, T, WIDTH, device=dev, generator=gen).to(torch.bfloat16)
    grad = torch.empty_like(proj)
    for D, off in ((768, 0), (1536, 1536)):
        x, dx = proj[..., off:off + D], grad[..., off:off + D]
        w = torch.randn(D, 4, device=dev, generator=gen) / 2
        dy = torch.randn(B, T, D, device=dev, generator=gen).to(torch.bfloat16)
        ref_dx, ref_dw = (t.clone() for t in sc._conv_bwd(dy, x, w, None, None, True, dx))
        floor = B * T * D * 6 / bw * 1e6
        bwd = lambda: sc._conv_bwd(dy, x, w, None, None, True, dx)  # noqa: E731
        rows = sweep("short_conv", {"L_min": (16, 32), "U": (4, 8), "warps_bwd": (1, 2, 4)}, bwd,
                     lambda out: max(_rel(out[0], ref_dx), _rel(out[1], ref_dw)))
        report(f"convolution backward [{B}, {T}, {D}]", floor, _us(bwd), rows, a.top)
        ref_y = sc._conv_fwd(x, w, None, None, True)
        fwd = lambda: sc._conv_fwd(x, w, None, None, True)  # noqa: E731
        rows = sweep("short_conv", {"BT": (32, 64), "BD": (128, 256)}, fwd,
                     lambda out: _rel(out, ref_y))
        report(f"convolution forward [{B}, {T}, {D}]", floor * 2 / 3, _us(fwd), rows, a.top)
    R, D = B * T, 1024
    s = torch.randn(R, D, device=dev, generator=gen)
    w = torch.ones(D, device=dev)
    rstd = torch.rand(R, device=dev, generator=gen) + 0.5
    dy = torch.randn(R, D, device=dev, generator=gen).to(torch.bfloat16)
    ds = torch.randn(R, D, device=dev, generator=gen)
    norm_grid = {"elements": (2048, 4096), "programs": (512, 1024, 2048)}
    run = lambda: rn._backward(dy, s, None, w, rstd, ds, torch.bfloat16)  # noqa: E731
    ref = run()[0].clone()
    rows = sweep("rmsnorm", norm_grid, run, lambda out: _rel(out[0], ref))
    report(f"residual add + norm backward [{R}, {D}]", R * D * 16 / bw * 1e6, _us(run), rows, a.top)
    R, D = B * T * 6, 256
    x = torch.randn(R, D, device=dev, generator=gen).to(torch.bfloat16)
    g = torch.randn(R, D, device=dev, generator=gen).to(torch.bfloat16)
    w = torch.ones(D, device=dev)
    rstd = torch.rand(R, device=dev, generator=gen) + 0.5
    dy = torch.randn(R, D, device=dev, generator=gen).to(torch.bfloat16)
    run = lambda: rn._backward(dy, x, g, w, rstd)  # noqa: E731
    ref = run()[0].clone()
    rows = sweep("rmsnorm", norm_grid, run, lambda out: _rel(out[0], ref))
    report(f"gated norm backward [{R}, {D}]", R * D * 10 / bw * 1e6, _us(run), rows, a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
