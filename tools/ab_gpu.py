"""Side-by-side GPU timing of launch-configuration variants of the gated delta rule's Triton path.

For each shape and each variant (a partial :func:`gdn.ops.tuning.update` argument), in one
process: forward and forward+backward median ms (``triton.testing.do_bench``), the largest relative
difference of o and every gradient against the first variant, and, with ``--profile``, the
forward's per-kernel GPU time. Correctness against float64 is ``pytest tests/gpu``; this only
checks that variants agree.

    python tools/ab_gpu.py --variants '[{}, {"fused_fwd": {"use": false}}]' [--shapes 0,1] [--profile]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn import ops  # noqa: E402
from gdn.ops import tuning  # noqa: E402

SHAPES = [  # (label, B, T, H, HV, packed lengths, V)
    ("(8, 2048, 16, 128)", 8, 2048, 16, 16, None, 128),
    ("(4, 8192, 16, 128)", 4, 8192, 16, 16, None, 128),
    ("(1, 32768, 16, 128)", 1, 32768, 16, 16, None, 128),
    ("(1, 8192, H=16, HV=32, 128)", 1, 8192, 16, 32, None, 128),
    ("packed 12 seqs, 32768", 1, 32768, 16, 16,
     [4096, 1000, 7000, 300, 2048, 5000, 64, 3000, 1500, 4260, 2500, 2000], 128),
    ("340m layer (4, 4096, 6, K=128, V=256)", 4, 4096, 6, 6, None, 256),
    ("(1, 32768, H=16, HV=64, 128)", 1, 32768, 16, 64, None, 128),
]


def inputs(B, T, H, HV, lens, V):
    q = torch.randn(B, T, H, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, 128, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda") + 3)
    beta = torch.rand(B, T, HV, device="cuda").sigmoid()
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return [x.requires_grad_(True) for x in (q, k, v, g, beta)], cu


def kernel_times(run, n=5, top=8):
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
    return total, [(e.device_time_total / n, e.key[:60]) for e in evs[:top]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", required=True, help="JSON list of partial tuning updates; the first is the base")
    ap.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES (default: all)")
    ap.add_argument("--profile", action="store_true", help="the forward's per-kernel GPU time under each variant")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    args = ap.parse_args()
    specs = json.loads(args.variants)
    idx = range(len(SHAPES)) if args.shapes is None else [int(s) for s in args.shapes.split(",")]
    saved = copy.deepcopy(tuning.TABLES)

    def restore():
        for name, table in tuning.TABLES.items():
            table.clear()
            table.update(copy.deepcopy(saved[name]))

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    print("| shape | variant | fwd ms | fwd+bwd ms | max rel diff vs first | fwd GPU µs |")
    print("|---|---|---|---|---|---|", flush=True)
    for i in idx:
        label, B, T, H, HV, lens, V = SHAPES[i]
        xs, cu = inputs(B, T, H, HV, lens, V)
        do = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)

        def f():
            return ops.gated_delta_rule(*xs, cu_seqlens=cu, backend="triton")[0]

        base = None
        for spec in specs:
            restore()
            tuning.update(spec)
            try:
                for x in xs:
                    x.grad = None
                o = f()
                res = [o.float().clone()]
                if not args.no_bwd:
                    o.backward(do)
                    res += [x.grad.float().clone() for x in xs]
                if base is None:
                    base, diff = res, 0.0
                else:
                    diff = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(res, base))
                with torch.no_grad():
                    t_f = do_bench(f, warmup=10, rep=100, return_mode="median")

                def fb():
                    for x in xs:
                        x.grad = None
                    f().backward(do)
                t_b = float("nan") if args.no_bwd else do_bench(fb, warmup=5, rep=100, return_mode="median")
                prof = ""
                if args.profile:
                    with torch.no_grad():
                        tot, top = kernel_times(f)
                    prof = f"{tot:.0f}: " + ", ".join(f"{n.split('(')[0]} {t:.0f}" for t, n in top)
                print(f"| {label} | {json.dumps(spec)} | {t_f:.3f} | {t_b:.3f} | {diff:.1e} | {prof} |", flush=True)
            except Exception as e:  # noqa: BLE001 - one failing variant must not stop the table
                print(f"| {label} | {json.dumps(spec)} | err | err | {type(e).__name__}: {str(e)[:200]} | |",
                      flush=True)
        restore()
        del xs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
