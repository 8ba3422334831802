"""Pick the launch configuration of each Triton chunk kernel on the GPU (coordinate descent).

For each kernel of :data:`gdn.ops.tuning.DELTA` in turn, every candidate below replaces that
kernel's entry, the op runs (forward for the forward kernels, forward+backward for the backward
ones) at the benchmark shapes, its outputs and gradients are compared with the current best
configuration's (a candidate that changes the numbers beyond bf16 noise is rejected: that is how a
miscompile shows), and it is timed with ``triton.testing.do_bench``; the fastest is kept before
the next kernel. Each kernel's sweep runs in its own process, so a candidate that faults (an
illegal memory access poisons the CUDA context) costs only that sweep. Prints the final table to
paste into ``DELTA`` in ``gdn/ops/tuning.py``, and a log of every candidate; ``--out`` writes it
as JSON for ``benchmarks/ops_gpu.py --config`` and ``pytest tests/gpu`` (``GDN_TUNING``).

    python tools/tune_gpu.py [--kernels state_fwd,output] [--shapes 4x8192,1x32768] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

FWD = ("kkt_solve", "wu", "state_out", "state_fwd", "output")
BWD = ("split", "dv_local", "state_bwd", "dqk", "wy_bwd", "chain")


def candidates(name):
    """Alternatives tried for one kernel (merged over its current entry)."""
    if name == "split":  # the split state passes (not a kernel): off, automatic, fixed segment lengths
        return [dict(L=x) for x in (0, -1, 16, 32, 64)]
    if name == "kkt_solve":
        return [dict(num_warps=w, BK=bk) for w in (2, 4) for bk in (32, 64)]
    if name in ("state_fwd", "state_bwd"):
        # their pipeline depth is the launch's (gdn.ops.triton.launch.by_waves, over the entry's
        # candidates); plain state_bwd at one stage must stay out of them (miscompiled, docs/TRITON.md)
        return [dict(SV=sv, num_warps=w) for sv in (2048, 4096, 8192) for w in (4, 8)]
    if name == "state_out":
        # the fused forward pass; its depth is the launch's too. Value tiles 32 or 64 (16 is below
        # its BV_min). Not one stage alone: forced to one stage at (8, 2048) bf16 (value tiles of 32)
        # it ended in an illegal memory access on the H200, and the sweep's process with it
        return [dict(SV=sv, num_warps=4) for sv in (4096, 8192)]
    if name == "chain":
        return [dict(num_warps=w, BC=bc, SV=sv) for w in (4, 8) for bc in (16, 32) for sv in (2048, 4096)]
    # dqk and wy_bwd also with pipelined loops (2-3 stages), as FLA autotunes its matching kernels
    # over 2-4 stages (tools/sass_cpu.py: both fit two programs per multiprocessor with 3 stages,
    # by registers)
    if name == "dqk":
        return ([dict(num_warps=w, BK=bk, BV=bv, stages=(1,)) for w in (4, 8) for bk, bv in ((64, 64), (64, 32), (128, 64))]
                + [dict(num_warps=4, BK=64, BV=64, stages=st) for st in ((2, 1), (3, 2, 1))])
    if name == "wy_bwd":
        return ([dict(num_warps=w, BK=b, BV=b, stages=(1,)) for w in (4, 8) for b in (32, 64)]
                + [dict(num_warps=w, BK=64, BV=64, stages=st) for w in (4, 8) for st in ((2, 1), (3, 2, 1))])
    # wu, output, dv_local
    return ([dict(num_warps=w, BK=bk, BV=bv, stages=(1,)) for w in (4, 8) for bk, bv in ((64, 64), (128, 64), (64, 128))]
            + [dict(num_warps=4, BK=64, BV=64, stages=(2, 1)), dict(num_warps=4, BK=64, BV=64, stages=(3, 2, 1))])


def sweep(name, base, shapes):
    """Run in a child process: time every candidate of ``name`` over ``base``; print JSON results."""
    import torch
    from triton.testing import do_bench

    from gdn import ops
    from gdn.ops import tuning

    tuning.update(base)
    bwd = name in BWD
    data = []
    for B, T in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        H = 16
        q = torch.randn(B, T, H, 128, device="cuda", generator=gen).bfloat16().requires_grad_(bwd)
        k = torch.nn.functional.normalize(torch.randn(B, T, H, 128, device="cuda", generator=gen), dim=-1)
        k = k.bfloat16().requires_grad_(bwd)
        v = torch.randn(B, T, H, 128, device="cuda", generator=gen).bfloat16().requires_grad_(bwd)
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + 3).requires_grad_(bwd)
        beta = torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen)).requires_grad_(bwd)
        do = torch.randn(B, T, H, 128, device="cuda", generator=gen).bfloat16()
        data.append((q, k, v, g, beta, do))

    def run(x):
        q, k, v, g, beta, do = x
        o, _ = ops.gated_delta_rule(q, k, v, g, beta, backend="triton")
        if not bwd:
            return [o]
        return [o] + list(torch.autograd.grad(o, (q, k, v, g, beta), do))

    def outputs():
        return [[t.float() for t in run(x)] for x in data]

    ref = outputs()
    results = []
    for cand in candidates(name):
        entry = dict(tuning.DELTA[name], **cand)
        saved = tuning.DELTA[name]
        tuning.DELTA[name] = entry
        try:
            t0 = time.perf_counter()
            got = outputs()
            compile_s = time.perf_counter() - t0
            err = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for gs, rs in zip(got, ref) for a, b in zip(gs, rs))
            ms = sum(do_bench(lambda x=x: run(x), warmup=10, rep=100, return_mode="median") for x in data)
            results.append(dict(cfg=entry, ms=ms, err=err, first_s=compile_s))
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile or fit is skipped
            results.append(dict(cfg=entry, ms=None, err=None, error=f"{type(e).__name__}: {str(e)[:160]}"))
            if "illegal" in str(e).lower() or "CUDA error" in str(e):
                break  # the context is poisoned: report what we have
        finally:
            tuning.DELTA[name] = saved
    print("RESULT " + json.dumps(results, default=list))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default=",".join(FWD + BWD), help="comma-separated kernel names, in order")
    p.add_argument("--shapes", default="4x8192,1x32768", help="BxT list (H=16, D=128, bf16)")
    p.add_argument("--out", default=None, help="also write the chosen DELTA table as JSON to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--base", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    if a.child:
        sweep(a.child, json.loads(a.base), shapes)
        return 0
    from gdn.ops.tuning import DELTA

    best = {k: dict(v) for k, v in DELTA.items()}
    for name in a.kernels.split(","):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, __file__, "--child", name, "--base", json.dumps(best, default=list),
                            "--shapes", a.shapes], capture_output=True, text=True)
        line = next((s for s in r.stdout.splitlines() if s.startswith("RESULT ")), None)
        if line is None:
            print(f"## {name}: sweep failed (rc {r.returncode})\n{r.stderr[-1500:]}", flush=True)
            continue
        res = json.loads(line[7:])
        print(f"## {name} ({time.perf_counter() - t0:.0f} s)")
        for x in res:
            print(f"  {x['cfg']}  ms={x['ms']}  err={x['err']}  first={x.get('first_s')}  {x.get('error', '')}")
        ok = [x for x in res if x["ms"] is not None and x["err"] is not None and x["err"] < 2e-2]
        if ok:
            win = min(ok, key=lambda x: x["ms"])
            best[name] = win["cfg"]
            print(f"  -> {win['cfg']} ({win['ms']:.3f} ms)", flush=True)
    print("DELTA = " + json.dumps(best, default=list, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(best, f, default=list, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
