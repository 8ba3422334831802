"""One forward+backward of gdn's chunk kernels and of FLA's at one shape, for Nsight Compute.

The per-kernel profile (`ops_gpu.py --profile`) says which kernels trail FLA's (at (4, 8192, 16,
128): state_bwd, wy_bwd, the forward's state pass); hardware counters say why (stall reasons,
issue rate, occupancy, bytes moved). This driver warms both implementations up (compiles, FLA's
autotuning) outside the profiled range and then runs one fwd+bwd of each inside
``cudaProfilerStart/Stop``, so `ncu --profile-from-start off` sees exactly those kernels:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
        -k 'regex:state_|dhu|fwd_kernel_h|wy|dqk|dv_local' python tools/ncu_kernels.py --shape 4x8192

(on the H200 machine, FLA's wheels carried as for `benchmarks/ops_gpu.py`, whose inputs and calls
this uses). Without ncu it just runs.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from ops_gpu import fla_fn, gdn_fn, inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4x8192", help="BxT (H = HV = 16, K = V = 128), e.g. 8x2048")
    ap.add_argument("--hv", type=int, default=16, help="value heads (grouped when above 16)")
    ap.add_argument("--no-fla", action="store_true", help="gdn only")
    ap.add_argument("--config", default=None, metavar="JSON",
                    help="launch overrides first (a file or inline JSON, gdn.ops.tuning.update_from), e.g. "
                         "'{\"fused_rbwd\": {\"on\": true}}'")
    args = ap.parse_args()
    from gdn.ops.tuning import apply_config  # noqa: PLC0415

    apply_config(ap, args.config)
    B, T = (int(x) for x in args.shape.lower().split("x"))
    xs, cu = inputs(B, T, 16, args.hv, None)
    do = torch.randn(B, T, args.hv, 128, device="cuda", dtype=torch.bfloat16)
    fns = [("gdn", gdn_fn(xs, cu))] + ([] if args.no_fla else [("FLA", fla_fn(xs, cu))])
    fns = [(n, f) for n, f in fns if f is not None]
    for _ in range(3):  # compile, autotune, warm the caches: outside the profiled range
        for _, f in fns:
            f().backward(do)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, f in fns:
        torch.cuda.nvtx.range_push(name)
        f().backward(do)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("ran", ", ".join(n for n, _ in fns), f"at B={B}, T={T}, HV={args.hv}")


if __name__ == "__main__":
    main()
