"""Chunked-op benchmark on the GPU: gdn's Triton kernels vs FLA 0.6.0 vs PyTorch SDPA (flash).

bf16 q/k/v, fp32 g and beta, Gated DeltaNet, K = V = 128, at (B, T, H, D) = (8, 2048, 16, 128),
(4, 8192, 16, 128), (1, 32768, 16, 128) (the same tokens per call at three sequence lengths);
grouped values (1, 8192, H = 16, HV = 32, 128); a packed batch of 12 sequences of mixed lengths
totalling 32768; one layer of the 340m model (K = 128, V = 256). Forward and forward+backward;
``--decode`` adds the rows of ``benchmarks/decode_gpu.py``. Timing only: correctness is
``pytest tests/gpu``.

Per row: median ms (``triton.testing.do_bench``), speed-up over FLA, achieved TFLOP/s and GB/s
(counted as below, against the card's ceilings measured in the same run: a bf16 8192³ matmul and
a device-to-device copy), and peak memory above the inputs.

FLOPs counted (chunk size C = 64, per token and value head, the matmuls of the chunk algorithm):
forward 2·(3CK + 2CV + 3KV); forward+backward counted as 3× forward. Bytes: each input read
once and each output written once (forward: q, k, v, g, beta, o; backward: those again, dO,
and every gradient).

FLA 0.6.0 refuses its gated backward under triton 3.6 on Hopper (FLA issue #640, a miscompile);
to time it anyway this script sets ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True``: FLA's
fwd+bwd figures are timed, not checked.

    python benchmarks/ops_gpu.py [--profile] [--decode]   # prints a markdown table
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn import ops  # noqa: E402

C = 64
SHAPES = [
    ("(8, 2048, 16, 128)", 8, 2048, 16, 16, None),
    ("(4, 8192, 16, 128)", 4, 8192, 16, 16, None),
    ("(1, 32768, 16, 128)", 1, 32768, 16, 16, None),
    ("(1, 8192, H=16, HV=32, 128)", 1, 8192, 16, 32, None),
    ("packed 12 seqs, 32768", 1, 32768, 16, 16,
     [4096, 1000, 7000, 300, 2048, 5000, 64, 3000, 1500, 4260, 2500, 2000]),
    # one layer of the 340m model in training (benchmarks/train.py): 6 heads, K = 128, V = 256
    ("340m layer (4, 4096, 6, K=128, V=256)", 4, 4096, 6, 6, None, 256),
]
D = 128


def ceilings():
    """(bf16 matmul FLOP/s, copy bytes/s) measured now."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median") * 1e-3
    x = torch.empty(2**29, device="cuda").normal_()
    y = torch.empty_like(x)
    cp = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median") * 1e-3
    return 2 * 8192**3 / mm, 2 * x.numel() * 4 / cp


def counts(B, T, H, HV, V=D):
    tokens = B * T
    fwd_flops = tokens * HV * 2 * (3 * C * D + 2 * C * V + 3 * D * V)
    ins = tokens * (2 * H * D * 2 + HV * V * 2 + HV * 4 * 2)  # q, k, v bf16; g, beta fp32
    out = tokens * HV * V * 2
    return fwd_flops, 3 * fwd_flops, ins + out, 2 * ins + 2 * out + ins


def inputs(B, T, H, HV, lens, V=D):
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda") + 3)
    beta = torch.rand(B, T, HV, device="cuda").sigmoid()
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return [x.requires_grad_(True) for x in (q, k, v, g, beta)], cu


def gdn_fn(xs, cu):
    return lambda: ops.gated_delta_rule(*xs, cu_seqlens=cu, backend="triton")[0]


def fla_fn(xs, cu):
    try:
        import fla.ops.common.chunk_o as fla_chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # FLA refuses its gated backward on triton 3.6 / Hopper otherwise
    cu_dev = None if cu is None else cu.to("cuda", torch.long)
    return lambda: chunk_gated_delta_rule(*xs, cu_seqlens=cu_dev, cu_seqlens_cpu=None if cu is None else cu.long())[0]


def sdpa_fn(B, T, HV, lens, V=D):
    q, k, v = (torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    if lens is None:
        def f():
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    else:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)

        def f():
            return ops.softmax_attention(q, k, v, cu_seqlens=cu)
    flops = 0
    for L in (lens or [T] * B):
        flops += 4 * HV * V * L * L / 2
    return f, flops


def timed(f, backward, do, xs=None):
    def run():
        o = f()
        if backward:
            o.backward(do)
    return do_bench(run, warmup=5, rep=60, grad_to_none=xs, return_mode="median")


def peak(f, backward, do):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = f()
    if backward:
        o.backward(do)
    del o
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def rows(out, rates, deadline=float("inf")):
    """Time every shape, appending each row to ``out`` as it is measured and the card's ceilings
    (matmul FLOP/s, copy bytes/s) to ``rates`` first, so a run that is cut short keeps what it
    measured; shapes not started before ``deadline`` (time.monotonic()) are skipped."""
    mm_rate, copy_bw = ceilings()
    rates[:] = [mm_rate, copy_bw]
    for name, B, T, H, HV, lens, *vd in SHAPES:
        if time.monotonic() > deadline:
            print(f"skipped {name}: past --max-seconds", flush=True)
            continue
        V = vd[0] if vd else D
        xs, cu = inputs(B, T, H, HV, lens, V)
        do = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
        f_fwd, f_all, b_fwd, b_all = counts(B, T, H, HV, V)
        sd, sd_flops = sdpa_fn(B, T, HV, lens, V)
        g = gdn_fn(xs, cu)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g().backward(do)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        for bwd in (False, True):
            r = {"shape": name, "pass": "fwd+bwd" if bwd else "fwd", "first_s": first_s}
            if bwd:
                r["gdn_ms"] = timed(g, True, do, xs)
            else:
                with torch.no_grad():
                    r["gdn_ms"] = timed(g, False, do)
            r["gdn_GB"] = peak(g, bwd, do)
            fl = fla_fn(xs, cu)
            try:
                if fl is None:
                    raise ImportError("fla not installed")
                if bwd:
                    r["fla_ms"] = timed(fl, True, do, xs)
                else:
                    with torch.no_grad():
                        r["fla_ms"] = timed(fl, False, do)
                r["fla_GB"] = peak(fl, bwd, do)
            except Exception as e:  # noqa: BLE001
                print(f"FLA failed at {name} {r['pass']}: {type(e).__name__}: {str(e)[:200]}")
                r["fla_ms"] = r["fla_GB"] = float("nan")
            try:
                if bwd:
                    r["sdpa_ms"] = timed(sd, True, do)
                else:
                    with torch.no_grad():
                        r["sdpa_ms"] = timed(sd, False, do)
            except Exception as e:  # noqa: BLE001
                print(f"SDPA failed at {name}: {type(e).__name__}: {str(e)[:200]}")
                r["sdpa_ms"] = float("nan")
            flops, nbytes = (f_all, b_all) if bwd else (f_fwd, b_fwd)
            r["tflops"] = flops / (r["gdn_ms"] * 1e-3) / 1e12
            r["pct_mm"] = 100 * flops / (r["gdn_ms"] * 1e-3) / mm_rate
            r["GBps"] = nbytes / (r["gdn_ms"] * 1e-3) / 1e9
            r["pct_copy"] = 100 * nbytes / (r["gdn_ms"] * 1e-3) / copy_bw
            r["speedup"] = r["fla_ms"] / r["gdn_ms"]
            out.append(r)
            print(r, flush=True)
        del xs
        torch.cuda.empty_cache()


def table(rs, mm_rate, copy_bw):
    """Print the markdown table of the rows measured."""
    print()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today()}. Ceilings measured in this run: bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s, "
          f"copy {copy_bw / 1e9:.0f} GB/s. Gated DeltaNet, bf16 q/k/v, fp32 g/beta, K = V = 128.")
    print("FLA fwd+bwd timed with fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True (its guard for triton 3.6).")
    print()
    print("| shape | pass | gdn ms | FLA ms | speed-up vs FLA | SDPA (flash) ms | gdn TFLOP/s (% mm) "
          "| gdn GB/s (% copy) | peak GiB gdn / FLA | gdn first call s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rs:
        print(f"| {r['shape']} | {r['pass']} | {r['gdn_ms']:.3f} | {r['fla_ms']:.3f} | {r['speedup']:.2f}× | "
              f"{r['sdpa_ms']:.3f} | {r['tflops']:.0f} ({r['pct_mm']:.0f}%) | {r['GBps']:.0f} ({r['pct_copy']:.0f}%) "
              f"| {r['gdn_GB']:.2f} / {r['fla_GB']:.2f} | {r['first_s']:.2f} |", flush=True)


def _restore(saved):
    """Put the launch tables of :mod:`gdn.ops.tuning` back to ``saved`` (a deep copy of
    ``tuning.TABLES``), in place: the kernel modules hold references to the same dicts."""
    import copy

    from gdn.ops import tuning

    for name, table in tuning.TABLES.items():
        table.clear()
        table.update(copy.deepcopy(saved[name]))


def variants(specs, prof=False):
    """gdn alone at every shape under each launch-configuration variant (a JSON list of partial
    :func:`gdn.ops.tuning.update` arguments, e.g. ``[{}, {"split": {"L": -1}},
    {"state_fwd": {"num_warps": 8}}]``): ms and the largest relative difference of o and every
    gradient against the first variant; with ``prof`` also the forward's per-kernel times under each."""
    import copy

    from gdn.ops import tuning

    saved = copy.deepcopy(tuning.TABLES)
    print("\n| shape | variant | fwd ms | fwd+bwd ms | max rel diff vs first |")
    print("|---|---|---|---|---|")
    for name, B, T, H, HV, lens, *vd in SHAPES:
        V = vd[0] if vd else D
        xs, cu = inputs(B, T, H, HV, lens, V)
        do = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
        g = gdn_fn(xs, cu)
        base = None
        for spec in specs:
            _restore(saved)
            tuning.update(spec)
            for x in xs:
                x.grad = None
            o = g()
            o.backward(do)
            res = [o.float().clone()] + [x.grad.float().clone() for x in xs]
            if base is None:
                base, diff = res, 0.0
            else:
                diff = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(res, base))
            with torch.no_grad():
                t_f = timed(g, False, do)
            t_b = timed(g, True, do, xs)
            print(f"| {name} | {json.dumps(spec)} | {t_f:.3f} | {t_b:.3f} | {diff:.1e} |", flush=True)
            if prof:
                with torch.no_grad():
                    kernel_times(g, f"gdn kernels at {name}, {json.dumps(spec)}, fwd", top=8)

                def fwd_bwd():
                    for x in xs:
                        x.grad = None
                    g().backward(do)
                kernel_times(fwd_bwd, f"gdn kernels at {name}, {json.dumps(spec)}, fwd+bwd", top=14)
        _restore(saved)
        del xs
        torch.cuda.empty_cache()


def kernel_times(run, label, n=5, top=14):
    """Print the per-kernel GPU time (µs per call of ``run``, torch.profiler, mean of n calls)."""
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            run()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in evs) / n
    print(f"\n{label}, µs per call (total {total:.0f} µs):")
    for e in evs[:top]:
        print(f"  {e.device_time_total / n:9.1f}  x{e.count // n:<3d} {e.key[:90]}")


def profile():
    """Per-kernel GPU time (µs per call) of one fwd+bwd at every shape, gdn and FLA, from torch.profiler."""
    for label, B, T, H, HV, lens, *vd in SHAPES:
        V = vd[0] if vd else D
        xs, cu = inputs(B, T, H, HV, lens, V)
        do = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
        for name, f in (("gdn", gdn_fn(xs, cu)), ("FLA", fla_fn(xs, cu))):
            if f is not None:
                kernel_times(lambda: f().backward(do), f"{name} kernels at {label}, fwd+bwd", top=18)


def main():
    import importlib.util

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", action="store_true", help="also the decode rows of benchmarks/decode_gpu.py")
    ap.add_argument("--profile", action="store_true", help="per-kernel times at every shape (torch.profiler)")
    ap.add_argument("--only-profile", action="store_true", help="only the per-kernel profile")
    ap.add_argument("--variants", default=None, metavar="JSON",
                    help="only gdn, timed under each of a JSON list of partial launch configurations")
    ap.add_argument("--config", default=None, metavar="FILE|JSON",
                    help="launch configurations to use: a JSON file (tools/tune_gpu.py --out) or an inline "
                         "partial configuration such as '{\"split\": {\"L\": -1}}' (gdn.ops.tuning.update_from)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no new shape after this many seconds (the table and what was measured still print)")
    ap.add_argument("--shapes", default=None, metavar="I,J",
                    help="only these rows of the shape list (0-based indices, comma-separated)")
    args = ap.parse_args()
    if args.shapes:
        SHAPES[:] = [SHAPES[int(i)] for i in args.shapes.split(",")]
    if args.config:
        from gdn.ops import tuning

        tuning.update_from(args.config)
        print("launch configuration overrides:", args.config)
    if args.variants:
        variants(json.loads(args.variants), args.profile)
        if not args.only_profile:
            return
    if args.only_profile:
        profile()
        return
    start = time.monotonic()
    deadline = start + args.max_seconds if args.max_seconds else float("inf")
    # a `timeout` (SIGTERM) still prints the table of the rows measured so far
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rs, rates = [], [float("nan"), float("nan")]
    try:
        rows(rs, rates, deadline)
    finally:
        table(rs, *rates)
    if args.profile and time.monotonic() < deadline:
        profile()
    dec = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_gpu.py")
    if args.decode and os.path.exists(dec):
        spec = importlib.util.spec_from_file_location("decode_gpu", dec)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        print()
        print(mod.markdown(mod.rows(rates[1])))


if __name__ == "__main__":
    main()
