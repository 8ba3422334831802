"""Reproduce and narrow down the open H200 fault of the Triton chunk kernels (docs/TRITON.md,
"Known problems"): gated_delta_rule at B = 2, T = 63, H = 2, HV = 4, K = 60, V = 16 in bf16 ends in
"an illegal memory access" (fp32 and V = 32 pass).

Each variant runs forward + backward in its own process with CUDA_LAUNCH_BLOCKING=1 (a fault poisons
the CUDA context, and blocking launches name the kernel that faulted); then the first failing
variant runs again under compute-sanitizer when it is installed, which prints the faulting access.

    python benchmarks/gpu_repro_v16.py [--no-sanitizer]   # the sanitizer's report, then a table of variants
    python benchmarks/gpu_repro_v16.py --configs '[{"wu": {"stages": [1]}}]'   # the case under overrides
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

#: (B, T, H, HV, K, V, dtype, member)
VARIANTS = [
    (2, 63, 2, 4, 60, 16, "bf16", "gated_delta_rule"),  # the failing case
    (2, 63, 2, 4, 60, 16, "bf16", "gated_delta_rule+pad32"),  # V zero-padded to 32 before the kernels
    (2, 63, 2, 4, 60, 16, "fp16", "gated_delta_rule"),
    (1, 63, 1, 1, 64, 16, "bf16", "gated_delta_rule"),
    (2, 64, 2, 4, 60, 16, "bf16", "gated_delta_rule"),
    (2, 63, 2, 4, 64, 16, "bf16", "linear_attention"),
    (2, 300, 2, 4, 128, 16, "bf16", "gated_delta_rule"),
    (2, 63, 2, 4, 60, 32, "bf16", "gated_delta_rule"),
    (2, 63, 2, 4, 60, 16, "fp32", "gated_delta_rule"),
]


def child(B, T, H, HV, K, V, dtype, member, cfg="{}"):
    import json

    import torch

    sys.path.insert(0, os.path.join(HERE, ".."))
    from gdn import ops
    from gdn.ops.triton._common import update_config

    update_config(json.loads(cfg))  # launch-configuration overrides of this variant

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if member.endswith("+pad32"):  # every feature dimension padded to at least 32 by the wrapper
        from gdn.ops.triton import chunk as triton_chunk

        member, pow2 = member[:-6], triton_chunk.pow2
        triton_chunk.pow2 = lambda n: max(32, pow2(n))
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device="cuda", dtype=dt, requires_grad=True)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(dt).requires_grad_()
    v = torch.randn(B, T, HV, V, device="cuda", dtype=dt, requires_grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device="cuda") + 3).requires_grad_()
    b = torch.rand(B, T, HV, device="cuda").requires_grad_()
    h0 = torch.randn(B, HV, K, V, device="cuda", requires_grad=True)
    args = {"gated_delta_rule": (q, k, v, g, b), "delta_rule": (q, k, v, b), "linear_attention": (q, k, v)}[member]
    try:
        o, S = getattr(ops, member)(*args, initial_state=h0, output_final_state=True, backend="triton")
        torch.cuda.synchronize()
        (o.float().sum() + S.sum()).backward()
        torch.cuda.synchronize()
        leaves = [x for x in (*args, h0)]
        got = [o.detach().double(), S.detach().double()] + [x.grad.double() for x in leaves]
        ref_in = [x.detach().double().requires_grad_(True) for x in leaves]
        o_r, S_r = getattr(ops, member)(*ref_in[:-1], initial_state=ref_in[-1], output_final_state=True,
                                        backend="chunk")
        (o_r.sum() + S_r.sum()).backward()
        ref = [o_r.detach(), S_r.detach()] + [x.grad for x in ref_in]
        errs = [float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(got, ref)]
        print("RESULT " + ("ok" if max(errs) < 3e-2 else "WRONG") + " max rel err " +
              " ".join(f"{e:.1e}" for e in errs))
    except Exception as e:  # noqa: BLE001 - the point is to report it
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "gdn/ops" in f.filename]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
        print(f"RESULT FAIL {type(e).__name__}: {str(e)[:120]} at {where}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        B, T, H, HV, K, V = (int(x) for x in sys.argv[2:8])
        child(B, T, H, HV, K, V, *sys.argv[8:11])
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "--configs":  # the failing case under each JSON override
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONUNBUFFERED="1")
        print("| launch-configuration override | result |\n|---|---|")
        cases = [VARIANTS[0], (2, 1, 2, 4, 16, 60, "bf16", "gated_delta_rule")]
        for cfg in json.loads(sys.argv[2]):
            for case in cases:
                cmd = [sys.executable, __file__, "--child", *map(str, case), json.dumps(cfg)]
                r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
                line = next((x[7:] for x in r.stdout.splitlines() if x.startswith("RESULT ")),
                            f"no result (rc {r.returncode})")
                print(f"| {case[:6]} {json.dumps(cfg)} | {line[:230]} |", flush=True)
        return 0
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONUNBUFFERED="1")
    sanitizer = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda-13.0/bin/compute-sanitizer")
         if os.path.exists(p)), None)
    if "--no-sanitizer" in sys.argv:
        sanitizer = None
    if sanitizer:  # first, the failing case with one cudaMalloc per tensor, so any stray access is caught
        cmd = [sys.executable, __file__, "--child", *map(str, VARIANTS[0])]
        print(f"compute-sanitizer (no caching allocator) on {VARIANTS[0]}:", flush=True)
        try:
            r = subprocess.run([sanitizer, "--print-limit", "4", *cmd], capture_output=True, text=True, timeout=240,
                               env=dict(env, PYTORCH_NO_CUDA_MEMORY_CACHING="1"))
            lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
            print("\n".join(lines[:70]), flush=True)
        except subprocess.TimeoutExpired:
            print("(sanitizer timed out)", flush=True)
    print("| B | T | H | HV | K | V | dtype | member | result |\n|---|---|---|---|---|---|---|---|---|")
    for var in VARIANTS:
        cmd = [sys.executable, __file__, "--child", *map(str, var)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        line = next((s[7:] for s in r.stdout.splitlines() if s.startswith("RESULT ")), f"no result (rc {r.returncode})")
        print("| " + " | ".join(map(str, var)) + f" | {line} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
