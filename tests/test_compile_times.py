"""tools/compile_times.py: every kernel of a workload compiled for sm_90 on the CPU, one line each
with its seconds, and an unknown workload is a usage error."""
from __future__ import annotations

import pytest

from .run_tool import run_tool

pytest.importorskip("triton")


def run(*args):
    return run_tool("compile_times.py", *args)


@pytest.mark.slow  # compiles a workload's kernels: `make test-all`
def test_times_every_kernel_of_a_workload():
    p = run("recurrent float32")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.strip().endswith(")") and " s  " in ln]
    names = {ln.split(" s  ")[1].split(" (")[0] for ln in lines}
    assert {"_fused_recurrent_fwd_kernel", "_kda_fwd_kernel"} <= names, p.stdout
    assert all(float(ln.split(" s ")[0]) > 0 for ln in lines)
    assert f"for {len(lines)} compiles" in p.stdout


def test_unknown_workload_is_a_usage_error():
    p = run("no such workload")
    assert p.returncode == 2 and "unknown workload" in p.stderr and "Traceback" not in p.stderr
