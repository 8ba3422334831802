"""The first call of a chunk op at a new shape, cold: a fresh process with an empty Triton cache
times its first forward (which compiles the forward's and the backward's kernels in parallel
threads), its first backward, then a second forward + backward (everything compiled).

    python tools/cold_start.py [--op gdn|kda] [--shape 8x2048] [--heads 16] [--dim 128] [--repeat 2]
    python tools/cold_start.py --op kda --timeline   # where the first forward's seconds go

``--timeline`` first runs a trivial Triton kernel (Triton's one-time setup of the process, timed
apart), then prints for each kernel compiled during the first forward its start and end (seconds
from the call) and the CPU seconds its thread spent, and the sum of those against the call's wall
time: compiles that overlap in wall time but whose CPU seconds add up to the span are serialised
(by the GIL or one busy core), not parallel.

Each repeat is a new process with its own empty cache directory (removed afterwards). Inputs:
bf16 q, k (L2-normalised), v; fp32 g = logsigmoid(N(0, 1) + 3) (per head for gdn, per channel for
kda); β ~ U(0, 1); the loss is Σ o². ``--device cpu`` runs the kernels under Triton's interpreter
(a check of the tool, not a timing).
"""
from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gdn.cli import _positive_int as positive  # noqa: E402  (the CLI's argument type: one message for all)


def trace_compiles():
    """Wrap Triton's compile entry point so each compile records (name, start, end, thread CPU s);
    returns the list the records go to."""
    import threading  # noqa: PLC0415

    import triton.compiler as tc  # noqa: PLC0415

    records, inner, lock = [], tc.compile, threading.Lock()

    def timed(src, *args, **kwargs):
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return inner(src, *args, **kwargs)
        finally:
            name = getattr(getattr(src, "fn", None), "__name__", "?")
            with lock:
                records.append((name, w0, time.perf_counter(), time.thread_time() - c0))

    tc.compile = timed
    return records


def setup_seconds() -> float:
    """Seconds of a trivial Triton kernel's first launch: Triton's one-time setup of the process."""
    import torch  # noqa: PLC0415
    import triton  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415

    @triton.jit
    def _one(x):
        tl.store(x, 1.0)

    x = torch.zeros(1, device="cuda")
    t0 = time.perf_counter()
    _one[(1,)](x)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def child(op: str, B: int, T: int, H: int, D: int, device: str, timeline: bool = False) -> None:
    """Run in the fresh process: build the inputs, time the calls, print one line."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    import gdn.ops as ops  # noqa: PLC0415

    torch.manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32  # (the interpreter's bf16 dots are not usable)
    q = torch.randn(B, T, H, D, device=device, dtype=dt, requires_grad=True)
    k = F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).to(dt).requires_grad_()
    v = torch.randn(B, T, H, D, device=device, dtype=dt, requires_grad=True)
    gshape = (B, T, H, D) if op == "kda" else (B, T, H)
    g = F.logsigmoid(torch.randn(*gshape, device=device) + 3).requires_grad_()
    b = torch.rand(B, T, H, device=device).requires_grad_()
    if device == "cuda":
        fn = functools.partial(ops.kimi_delta_attention if op == "kda" else ops.gated_delta_rule, backend="triton")
    else:  # the same kernels under the interpreter (the op's router sends CPU tensors elsewhere)
        from gdn.ops.delta.triton.chunk import chunk_op  # noqa: PLC0415
        from gdn.ops.kda.triton.chunk import chunk_kda  # noqa: PLC0415

        fn = chunk_kda if op == "kda" else chunk_op

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    sync()
    records = None
    if timeline and device == "cuda":
        print(f"Triton setup (a trivial kernel's first launch): {setup_seconds():.2f} s", flush=True)
        records = trace_compiles()
    t0 = time.perf_counter()
    o, _ = fn(q, k, v, g, b)
    sync()
    t1 = time.perf_counter()
    if records is not None:
        for name, w0, w1, cpu in sorted(records, key=lambda r: r[1]):
            print(f"  {name:28s} {w0 - t0:6.2f} → {w1 - t0:6.2f} s  (wall {w1 - w0:5.2f}, thread CPU {cpu:5.2f})")
        print(f"  {len(records)} compiles: thread CPU {sum(r[3] for r in records):.2f} s, wall of the forward "
              f"{t1 - t0:.2f} s", flush=True)
    o.float().square().sum().backward()
    sync()
    t2 = time.perf_counter()
    for x in (q, k, v, g, b):
        x.grad = None
    o, _ = fn(q, k, v, g, b)
    o.float().square().sum().backward()
    sync()
    t3 = time.perf_counter()
    print(f"{op} ({B}, {T}, {H}, {D}): first forward {t1 - t0:.2f} s, first backward {t2 - t1:.2f} s, "
          f"second forward + backward {t3 - t2:.3f} s", flush=True)


def shape(text: str) -> tuple[int, int]:
    try:
        B, T = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BxT such as 8x2048, got {text!r}") from None
    if B < 1 or T < 1:
        raise argparse.ArgumentTypeError(f"B and T must be positive, got {text!r}")
    return B, T


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=("gdn", "kda"), default="gdn", help="gated delta rule or Kimi Delta Attention")
    ap.add_argument("--shape", type=shape, default=(8, 2048), metavar="BxT")
    ap.add_argument("--heads", type=positive, default=16)
    ap.add_argument("--dim", type=positive, default=128, help="K = V")
    ap.add_argument("--repeat", type=positive, default=1, help="cold processes, one after another")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--timeline", action="store_true", help="per-kernel compile times of the first forward")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    (B, T), H, D = a.shape, a.heads, a.dim
    if a.child:
        child(a.op, B, T, H, D, a.device, a.timeline)
        return 0
    for _ in range(a.repeat):
        cache = tempfile.mkdtemp(prefix="gdn-cold-")
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        if a.device == "cpu":
            env["TRITON_INTERPRET"] = "1"
        try:
            p = subprocess.run([sys.executable, __file__, "--child", "--op", a.op, "--shape", f"{B}x{T}",
                                "--heads", str(H), "--dim", str(D), "--device", a.device]
                               + (["--timeline"] if a.timeline else []), env=env)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        if p.returncode:
            return p.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
