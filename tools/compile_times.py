"""Seconds to compile each kernel of a workload for the H200 (sm_90), one after another, on this
machine's CPU: what a first call at a new shape waits for (its compiles run in parallel threads,
so the longest one bounds it from below). The launches are tools/ptx_fingerprint.py's (its CPU
workloads, each compiled as Triton's launcher would); a fresh Triton cache is used so nothing is
read back.

    python tools/compile_times.py ["chunk bfloat16 g=True beta=True"]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gdn-compile-times-")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

from tools import ptx_fingerprint as F  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", nargs="?", default="chunk bfloat16 g=True beta=True",
                    help="a workload name of tools/ptx_fingerprint.py (default: a gated delta rule fwd+bwd, bf16)")
    a = ap.parse_args(argv)
    found = dict(F.workloads([torch.float32, torch.bfloat16]))
    if a.workload not in found:
        ap.error(f"unknown workload {a.workload!r}; one of: {', '.join(found)}")
    with F.captured() as launches:
        found[a.workload]()
    backend, binders, seen = make_backend(F.TARGET), {}, {}
    for kernel, args, kw in launches:
        text, (k, sig, consts, attrs, opts) = F.launch_key(kernel, tuple(args), kw, backend, binders)
        if text in seen:
            continue
        t = time.perf_counter()
        triton.compile(ASTSource(k, sig, consts, attrs), target=F.TARGET, options=opts.__dict__)
        seen[text] = (kernel.fn.__name__, kw.get("num_stages"), time.perf_counter() - t)
    rows = sorted(seen.values(), key=lambda r: -r[2])
    for name, stages, dt in rows:
        print(f"{dt:6.2f} s  {name} (stages {stages})")
    print(f"{sum(r[2] for r in rows):.1f} s for {len(rows)} compiles on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
