"""tools/launch_key_cpu.py: fused_bwd's launch through gdn's launch path on the CPU, the C launch
faked behind triton's own descriptor wrapper: every argument reaches the C function (34 arguments,
twelve descriptors each expanded to its map, shape and strides) and a time per launch is printed."""
from __future__ import annotations

import pytest

from .run_tool import run_tool

pytest.importorskip("triton")


def _run(*args):
    return run_tool("launch_key_cpu.py", *args, timeout=300)


def test_times_a_descriptor_launch():
    res = _run("--rounds", "2", "--calls", "3")
    assert res.returncode == 0, res.stderr
    assert "µs of Python per launch" in res.stdout and "95 arguments reached the C function" in res.stdout, res.stdout


def test_bad_counts_are_usage_errors():
    res = _run("--rounds", "0")
    assert res.returncode == 2 and "--rounds and --calls must be positive" in res.stderr and "Traceback" not in res.stderr
