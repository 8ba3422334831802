"""tools/host_profile.py --cpu-stub --timeline: the marks of a forward + backward come out in call
order (the Function's forward, its launches, its backward), each span non-negative."""
from __future__ import annotations

import os
import re

import pytest

from .run_tool import run_tool

pytest.importorskip("triton")


def test_timeline_marks_in_call_order():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = run_tool("host_profile.py", "--cpu-stub", "--timeline", "--shape", "1x128", "--heads", "2", "--hv", "2", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [(float(m.group(1)), m.group(2)) for m in re.finditer(r"^\s+(-?[\d.]+)\s+(.+)$", p.stdout, re.M)]
    marks = [r for _, r in rows]
    assert marks[0] == "call> → Function.forward>" and marks[-1] == "in all", marks
    order = [m for m in marks if "> → <" in m]  # the launches' own spans, in call order
    assert order[0] == "kkt_solve> → <kkt_solve" and "state_bwd> → <state_bwd" in order, order
    assert marks.index("<Function.forward → Function.backward>") < marks.index("state_bwd> → <state_bwd")
    assert all(us >= 0 for us, _ in rows) and rows[-1][0] > 0


def test_config_overrides_reach_the_calls():
    """--config applies launch overrides before the calls: on the H200's host path (--hopper) the
    merged backward takes a forward + backward in four launches where the reverse pass and the
    per-chunk kernel take five or more; a bad JSON is one line, exit status 2."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ("--cpu-stub", "--hopper", "--shape", "1x256", "--heads", "2", "--hv", "2", "--top", "1")

    def launches(*extra):
        p = run_tool("host_profile.py", *args, *extra, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        return int(re.search(r"forward\+backward\s+host\s+[\d.]+ µs/call\s+\((\d+) launches\)", p.stdout).group(1))

    assert launches("--config", '{"fused_rbwd": {"on": true}}') == 4 < launches()
    bad = run_tool("host_profile.py", *args, "--config", "{oops", env=env)
    assert bad.returncode == 2 and "--config" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_stub_keeps_freed_blocks_in_the_heap():
    """Under --cpu-stub the tool runs itself again with glibc keeping freed large blocks for reuse
    (as CUDA's caching allocator does), started without those settings or with them."""
    from tools.host_profile import HEAP_ENV

    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and k not in HEAP_ENV}
    for env in (base, {**base, **HEAP_ENV}):
        p = run_tool("host_profile.py", "--cpu-stub", "--shape", "1x128", "--heads", "2", "--hv", "2", "--top", "1",
                     env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "freed blocks kept in the heap" in p.stdout.splitlines()[0], p.stdout[:300]


def test_calibrate_prints_its_four_workloads():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = run_tool("host_profile.py", "--calibrate", env=env)
    assert p.returncode == 0, p.stderr
    rows = re.findall(r"^\s+([\d.]+) µs  (.+)$", p.stdout, re.M)
    assert [w for _, w in rows] == ["pure-Python loop (200 dict updates)", "autograd Function forward + backward",
                                    "torch.empty, 64 MB", "a view (reshape)"], p.stdout
    assert all(float(us) > 0 for us, _ in rows)
