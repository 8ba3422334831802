"""Compile time, shared memory, registers and spills of the chunk kernels for sm_90, no GPU needed.

Every chunk kernel of the scalar-gate family is compiled for Hopper (sm_90) on any machine, and
the report gives its compile time, shared memory, registers and register spills (stack frame).

It runs the real launchers of :mod:`gdn.ops.delta.triton.chunk_fwd` / ``chunk_bwd`` (forward and
backward of one small call) with the launch intercepted: each launch is compiled ahead of time
with ``triton.compile`` for sm_90 as Triton's launcher would (its binder's specialisation of the
arguments), at the warps and first pipelining candidate of its :data:`gdn.ops.tuning.DELTA` entry,
and its cubin is read with the ``cuobjdump`` bundled with Triton.

    python tools/resources.py [--K 128] [--V 128] [--dtype bf16] [--member gated_delta_rule]

Needs a Triton with the NVIDIA backend (not the interpreter: run without TRITON_INTERPRET).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.compiler import ASTSource, make_backend

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn.ops.delta.triton import chunk_bwd, chunk_fwd  # noqa: E402
from gdn.ops.delta.triton.chunk import chunk_op  # noqa: E402
from gdn.ops.triton import common  # noqa: E402
from gdn.ops.triton import launch as launcher  # noqa: E402
from gdn.ops.tuning import DELTA  # noqa: E402
from ptx_fingerprint import TARGET, launch_key  # noqa: E402  (the launcher's own compile inputs)

_BACKEND, _BINDERS = make_backend(TARGET), {}


def compile_report(kernel, args, meta, num_warps, num_stages):
    """(seconds, shared bytes, 'REG:n STACK:n') of one kernel compiled for sm_90 as Triton's
    launcher compiles it (:func:`ptx_fingerprint.launch_key`: the binder's specialisation)."""
    _, (k, sig, consts, attrs, options) = launch_key(kernel, args, dict(meta, num_warps=num_warps,
                                                                         num_stages=num_stages), _BACKEND, _BINDERS)
    t0 = time.perf_counter()
    c = triton.compile(ASTSource(k, sig, consts, attrs), target=TARGET, options=options.__dict__)
    secs = time.perf_counter() - t0
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    usage = next((" ".join(line.split()[0:2]) for line in out.splitlines() if "REG:" in line), "?")
    return secs, c.metadata.shared, usage


def report(K=128, V=128, dtype=torch.bfloat16, member="gated_delta_rule", H=16, HV=16, T=64):
    """Compile the kernels of one forward + backward and return one row per launch."""
    rows = []

    def fake_launch(kernel, grid, *args, name, config=None, **meta):
        entry = (DELTA if config is None else config)[name]
        warps = entry["num_warps"]
        ns, form = launcher.candidates(entry["stages"])[0]
        secs, shared, usage = compile_report(kernel, args, dict(meta, **form), warps, ns)
        rows.append((kernel.fn.__name__, warps, ns, secs, shared, usage))

    # each module that calls launch() holds its own reference to it: chunk_fwd and chunk_bwd import
    # it from gdn.ops.triton.common, which re-exports gdn.ops.triton.launch's and calls it itself
    holders = (chunk_fwd, chunk_bwd, common, launcher)
    saved = [m.launch for m in holders]
    for m in holders:
        m.launch = fake_launch
    try:
        q = torch.randn(1, T, H, K, dtype=dtype, requires_grad=True)
        k = torch.randn(1, T, H, K, dtype=dtype, requires_grad=True)
        v = torch.randn(1, T, HV, V, dtype=dtype, requires_grad=True)
        g = -torch.rand(1, T, HV, requires_grad=True) if "gated" in member else None
        beta = torch.rand(1, T, HV, requires_grad=True) if "delta" in member else None
        h0 = torch.zeros(1, HV, K, V, requires_grad=True)
        o, S = chunk_op(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        (o.float().sum() + S.sum()).backward()
    finally:
        for m, fn in zip(holders, saved):
            m.launch = fn
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--K", type=int, default=128, help="key head dim")
    ap.add_argument("--V", type=int, default=128, help="value head dim")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="input dtype")
    ap.add_argument("--member", default="gated_delta_rule",
                    choices=["gated_delta_rule", "delta_rule", "gated_linear_attention", "linear_attention"],
                    help="which member's kernels")
    a = ap.parse_args(argv)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    rows = report(a.K, a.V, dt, a.member)
    print(f"{a.member} K={a.K} V={a.V} {a.dtype}, sm_90, triton {triton.__version__}")
    print("| kernel | warps | stages | compile s | shared KB | registers / stack bytes |")
    print("|---|---|---|---|---|---|")
    for name, w, st, secs, shared, usage in rows:
        print(f"| {name} | {w} | {st} | {secs:.1f} | {shared / 1024:.1f} | {usage} |")
    print(f"total compile {sum(r[3] for r in rows):.1f} s (kernels compiled once per process here)")


if __name__ == "__main__":
    main()
