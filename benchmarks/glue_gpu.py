"""GPU check and timing of the model's Triton glue: the causal short convolution
(``gdn.ops.triton.short_conv``) and the RMSNorm / gated RMSNorm passes (``gdn.ops.triton.rmsnorm``),
against the PyTorch Functions of ``gdn.layers.conv`` / ``gdn.layers.norm``, at the 340m training shapes.

Checks, for fp32 and bf16: every output and gradient (x, weight, history, gate) as relative RMS
error against the PyTorch path run in float64 on the same inputs; bound 1e-5 in fp32, and in bf16
twice the PyTorch path's own error in bf16, at least 1e-2 (one bf16 rounding is ~2e-3, a wrong
kernel is O(1)). Cases: conv [4, 4096, 768] and [4, 4096, 1536] (K = 4, SiLU), with a history
that needs grad, packed sequences (with a one-token and an empty member) and no activation;
RMSNorm [4, 4096, 1024]; gated RMSNorm [4·4096·6, 256].
Then that the modules (ShortConvolution, RMSNorm, GatedRMSNorm) dispatch to Triton on CUDA and
keep their autocast output dtypes. Then ms (``do_bench`` medians) of forward and forward+backward,
Triton against PyTorch. Prints ok/FAIL per case and a markdown table; exits non-zero on a failure.

    python benchmarks/glue_gpu.py          # ~1 min on an H200
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn.layers import GatedRMSNorm, RMSNorm, ShortConvolution  # noqa: E402
from gdn.layers.conv import _conv_act, _ConvActFn  # noqa: E402
from gdn.layers.norm import _GatedRMSNormFn, _RMSNormFn  # noqa: E402
from gdn.ops.triton.rmsnorm import gated_rms_norm, rms_norm  # noqa: E402
from gdn.ops.triton.short_conv import short_conv  # noqa: E402

DEV = "cuda"


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def grads(fn, inputs, dy):
    """Output and gradients of ``fn(*inputs)`` for the inputs that need them, given dy."""
    ins = [t.detach().clone().requires_grad_(need) if t is not None else None for t, need in inputs]
    y = fn(*ins)
    wrt = [t for t in ins if t is not None and t.requires_grad]
    return [y.detach(), *torch.autograd.grad(y, wrt, dy.to(y.dtype))]


class Report:
    def __init__(self):
        self.rows, self.failed = [], False

    def check(self, case, names, ours, theirs, ref, dtype):
        for name, a, b, r in zip(names, ours, theirs, ref):
            err = rel(a, r)
            bound = 1e-5 if dtype == torch.float32 else max(2 * rel(b, r), 1e-2)
            ok = err <= bound and a.dtype == b.dtype
            self.failed |= not ok
            line = (f"| {case} {name} | {dtype} | {err:.1e} | torch {rel(b, r):.1e} | {bound:.1e} "
                    f"| {'ok' if ok else 'FAIL'} |")
            print(line, flush=True)
            self.rows.append(line)

    def flag(self, case, ok):
        self.failed |= not ok
        line = f"| {case} | | | | | {'ok' if ok else 'FAIL'} |"
        print(line, flush=True)
        self.rows.append(line)


def torch_conv(x, w, h, cu, act):
    if cu is None and h is None:
        h = x.new_zeros(x.shape[0], x.shape[2], w.shape[1] - 1)
    return _ConvActFn.apply(x, w, h, cu, act)


def check_conv(rep, dtype, B, T, D, act="silu", with_hist=False, lens=None):
    gen = torch.Generator(device=DEV).manual_seed(T + D)
    x = torch.randn(B, T, D, device=DEV, generator=gen).to(dtype)
    w = torch.randn(D, 4, device=DEV, generator=gen) / 2
    h = torch.randn(B, D, 3, device=DEV, generator=gen).to(dtype) if with_hist else None
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    dy = torch.randn(B, T, D, device=DEV, generator=gen).to(dtype)
    inputs = [(x, True), (w, True), (h, True)]
    ref = grads(lambda a, b, c: torch_conv(a, b, c, cu, act), [(t.double() if t is not None else None, n)
                                                               for t, n in inputs], dy.double())
    ours = grads(lambda a, b, c: short_conv(a, b, c, cu, act), inputs, dy)
    theirs = grads(lambda a, b, c: torch_conv(a, b, c, cu, act), inputs, dy)
    case = f"conv [{B}, {T}, {D}] {act}" + (" hist" if with_hist else "") + (f" packed {len(lens)}" if lens else "")
    rep.check(case, ["y", "dx", "dw", "dhist"][:len(ref)], ours, theirs, ref, dtype)


def check_norm(rep, dtype, shape, gated):
    gen = torch.Generator(device=DEV).manual_seed(shape[-1])
    x = (2 * torch.randn(shape, device=DEV, generator=gen)).to(dtype)
    g = (2 * torch.randn(shape, device=DEV, generator=gen)).to(dtype)
    w = 1 + 0.5 * torch.randn(shape[-1], device=DEV, generator=gen)
    dy = torch.randn(shape, device=DEV, generator=gen).to(dtype)
    if gated:
        inputs = [(x, True), (g, True), (w, True)]
        ref = grads(lambda a, b, c: _GatedRMSNormFn.apply(a, b, c, 1e-6), [(t.double(), n) for t, n in inputs],
                    dy.double())
        ours = grads(lambda a, b, c: gated_rms_norm(a, b, c, 1e-6), inputs, dy)
        theirs = grads(lambda a, b, c: _GatedRMSNormFn.apply(a, b, c, 1e-6), inputs, dy)
        rep.check(f"gated norm {list(shape)}", ["y", "dx", "dgate", "dw"], ours, theirs, ref, dtype)
    else:
        inputs = [(x, True), (w, True)]
        ref = grads(lambda a, b: _RMSNormFn.apply(a, b, 1e-6, torch.float64), [(t.double(), n) for t, n in inputs],
                    dy.double())
        ours = grads(lambda a, b: rms_norm(a, b, 1e-6), inputs, dy)
        theirs = grads(lambda a, b: _RMSNormFn.apply(a, b, 1e-6, dtype), inputs, dy)
        rep.check(f"rmsnorm {list(shape)}", ["y", "dx", "dw"], ours, theirs, ref, dtype)


def check_modules(rep):
    """The layers pick the Triton path on CUDA and keep their dtypes under autocast."""
    x = torch.randn(2, 64, 96, device=DEV)
    conv, norm, gnorm = ShortConvolution(96).to(DEV), RMSNorm(96).to(DEV), GatedRMSNorm(96).to(DEV)
    with torch.no_grad():
        rep.flag("ShortConvolution uses the Triton conv", torch.equal(conv(x)[0], short_conv(x, conv.weight)))
        rep.flag("RMSNorm uses the Triton norm", torch.equal(norm(x), rms_norm(x, norm.weight, norm.eps)))
        rep.flag("GatedRMSNorm uses the Triton norm",
                 torch.equal(gnorm(x, x.flip(0)), gated_rms_norm(x, x.flip(0), gnorm.weight, gnorm.eps)))
        with torch.autocast(DEV, dtype=torch.bfloat16):
            yc, yn, yg = conv(x)[0], norm(x), gnorm(x, x)
            yc_ref = _conv_act(x, conv.weight, x.new_zeros(2, 96, 3), None, "silu")
        rep.flag("autocast dtypes (conv, norm, gated norm) = torch's",
                 (yc.dtype, yn.dtype, yg.dtype) == (yc_ref.dtype, torch.bfloat16, torch.float32))
        state = torch.randn(2, 96, 3, device=DEV)
        y1, s1 = conv(x, state=state, output_state=True)
        y2 = _conv_act(x, conv.weight, state, None, "silu")
        rep.flag("ShortConvolution with a state", rel(y1, y2) <= 1e-5 and s1.shape == (2, 96, 3))


def bench(fn_fwd, args, dy):
    from triton.testing import do_bench

    with torch.no_grad():
        t_f = do_bench(lambda: fn_fwd(*args), return_mode="median")
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def step():
        fn_fwd(*args).backward(dy)

    t_fb = do_bench(step, grad_to_none=leaves, return_mode="median")
    return t_f, t_fb


def timings(rep):
    gen = torch.Generator(device=DEV).manual_seed(1)
    dt = torch.bfloat16
    for D in (768, 1536):
        x = torch.randn(4, 4096, D, device=DEV, generator=gen).to(dt).requires_grad_()
        w = (torch.randn(D, 4, device=DEV, generator=gen) / 2).requires_grad_()
        dy = torch.randn_like(x)
        h0 = x.new_zeros(4, D, 3)
        t_ours = bench(lambda a, b: short_conv(a, b, None, None, "silu"), (x, w), dy)
        t_torch = bench(lambda a, b: _ConvActFn.apply(a, b, h0, None, "silu") if torch.is_grad_enabled()
                        else _conv_act(a, b, h0, None, "silu"), (x, w), dy)
        rep.rows.append(f"| conv [4, 4096, {D}] SiLU ms fwd / fwd+bwd | bf16 "
                        f"| triton {t_ours[0]:.3f} / {t_ours[1]:.3f} "
                        f"| torch {t_torch[0]:.3f} / {t_torch[1]:.3f} | | |")
    x = torch.randn(4, 4096, 1024, device=DEV, generator=gen).to(dt).requires_grad_()
    w = torch.ones(1024, device=DEV, requires_grad=True)
    dy = torch.randn_like(x)
    t_ours = bench(lambda a, b: rms_norm(a, b, 1e-6), (x, w), dy)
    t_torch = bench(lambda a, b: _RMSNormFn.apply(a, b, 1e-6, dt), (x, w), dy)
    rep.rows.append(f"| rmsnorm [4, 4096, 1024] ms fwd / fwd+bwd | bf16 | triton {t_ours[0]:.3f} / {t_ours[1]:.3f} "
                    f"| torch {t_torch[0]:.3f} / {t_torch[1]:.3f} | | |")
    x = torch.randn(4 * 4096 * 6, 256, device=DEV, generator=gen).to(dt).requires_grad_()
    g = torch.randn(4 * 4096 * 6, 256, device=DEV, generator=gen).to(dt).requires_grad_()
    w = torch.ones(256, device=DEV, requires_grad=True)
    dy = torch.randn_like(x)
    t_ours = bench(lambda a, b, c: gated_rms_norm(a, b, c, 1e-6), (x, g, w), dy)
    t_torch = bench(lambda a, b, c: _GatedRMSNormFn.apply(a, b, c, 1e-6), (x, g, w), dy)
    rep.rows.append(f"| gated norm [98304, 256] ms fwd / fwd+bwd | bf16 | triton {t_ours[0]:.3f} / {t_ours[1]:.3f} "
                    f"| torch {t_torch[0]:.3f} / {t_torch[1]:.3f} | | |")


def main() -> int:
    start = time.perf_counter()
    rep = Report()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        check_conv(rep, dtype, 4, 4096, 768)
        check_conv(rep, dtype, 4, 4096, 1536)
        check_conv(rep, dtype, 4, 4096, 768, with_hist=True)
        check_conv(rep, dtype, 2, 37, 100, act=None, with_hist=True)
        check_conv(rep, dtype, 1, 8192, 768, lens=[1, 0, 3000, 5, 4096, 1090])
        check_conv(rep, dtype, 1, 50, 7, act=None, lens=[1, 0, 49])
        check_norm(rep, dtype, (4, 4096, 1024), False)
        check_norm(rep, dtype, (4 * 4096 * 6, 256), True)
        check_norm(rep, dtype, (3, 17, 100), True)
        check_norm(rep, dtype, (5, 7), False)
    check_modules(rep)
    timings(rep)
    print("| case | dtype | rel. error (or ms) | torch's error (or ms) | bound | |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rep.rows))
    print(f"{time.perf_counter() - start:.0f} s")
    print("SOME CHECKS FAILED" if rep.failed else "ALL OK")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
