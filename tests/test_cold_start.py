"""tools/cold_start.py: a fresh process per repeat times the first forward, first backward and a
second forward + backward (here under Triton's interpreter on the CPU, a check of the plumbing);
bad arguments are usage errors."""
from __future__ import annotations

import re

import pytest

from .run_tool import run_tool

pytest.importorskip("triton")


def run(*args):
    return run_tool("cold_start.py", *args)


@pytest.mark.slow  # two fresh processes compiling a forward each: `make test-all`
@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_times_each_cold_process(op):
    p = run("--op", op, "--shape", "1x70", "--heads", "1", "--dim", "16", "--repeat", "2", "--device", "cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(f"{op} (1, 70, 1, 16)")]
    assert len(lines) == 2, p.stdout
    pat = r"first forward (\d+\.\d+) s, first backward (\d+\.\d+) s, second forward \+ backward (\d+\.\d+) s"
    assert all(re.search(pat, ln) for ln in lines), lines


@pytest.mark.parametrize("args,word", [(["--shape", "8by2048"], "BxT"), (["--heads", "0"], "positive"),
                                       (["--op", "mamba"], "invalid choice")])
def test_bad_arguments_are_usage_errors(args, word):
    p = run(*args)
    assert p.returncode == 2 and word in p.stderr and "Traceback" not in p.stderr
