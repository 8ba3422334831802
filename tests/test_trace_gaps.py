"""tools/trace_gaps.py on a hand-made trace: busy time as the union of the device intervals, and each
idle gap charged to the host (with the outermost operator that issued the next launch) or to the
queue."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import trace_gaps  # noqa: E402


def _x(cat, name, ts, dur, corr=None, tid=1):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _trace():
    return {"traceEvents": [
        # host: a forward op launching kernel 1, a backward node launching 2 (late) and 3 (early)
        _x("cpu_op", "aten::linear", 0, 20), _x("cpu_op", "aten::mm", 2, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 5, 2, corr=1),
        _x("cpu_op", "autograd::engine::evaluate_function: FooBackward", 100, 60),
        _x("cpu_op", "aten::empty", 110, 3),
        _x("cuda_driver", "cuLaunchKernelEx", 140, 3, corr=2),
        _x("cuda_runtime", "cudaLaunchKernel", 150, 3, corr=3),
        # device: kernel 1 [10, 50), kernel 2 [145, 175) after a gap the host caused (launched at 140
        # > 50), a copy overlapping it, kernel 3 [180, 190) after a queued gap (launched at 150 < 175)
        _x("kernel", "k1", 10, 40, corr=1, tid=99),
        _x("kernel", "k2", 145, 30, corr=2, tid=99),
        _x("gpu_memcpy", "copy", 160, 20, tid=98),
        _x("kernel", "k3", 185, 5, corr=3, tid=99),
        {"ph": "s", "cat": "ac2g", "id": 1, "ts": 5},  # flow events and others are ignored
    ]}


def test_busy_idle_and_gaps_charged():
    r = trace_gaps.analyse(_trace(), min_us=1.0)
    assert r["span"] == pytest.approx(180.0)  # 10 .. 190
    assert r["busy"] == pytest.approx(40 + 35 + 5)  # [10, 50), [145, 180), [185, 190)
    assert r["idle"] == pytest.approx(100.0)
    assert r["gaps"] == 2
    assert r["host_late"] == pytest.approx(95.0)  # 50 .. 145, launched at 140
    assert r["queued"] == pytest.approx(5.0)  # 180 .. 185, launched at 150
    assert r["by_op"] == [("autograd::engine::evaluate_function: FooBackward", pytest.approx(95.0), 1)]
    # the copy ends last before k3's gap: it is the work before that gap
    assert r["longest"] == [(pytest.approx(95.0), "k1", "k2", "autograd::engine::evaluate_function: FooBackward"),
                            (pytest.approx(5.0), "copy", "k3", "queued")]


def test_short_gaps_are_not_counted():
    r = trace_gaps.analyse(_trace(), min_us=10.0)
    assert r["gaps"] == 1 and r["queued"] == 0.0 and r["idle"] == pytest.approx(100.0)


def test_launch_outside_any_operator():
    t = _trace()
    for e in t["traceEvents"]:
        if e.get("name", "").startswith("autograd"):
            e["dur"] = 30  # ends at 130, before the launch at 140
    r = trace_gaps.analyse(t, min_us=1.0)
    assert r["by_op"][0][0] == "(between operators)"


def test_cli_reads_gzip_and_rejects_a_bad_file(tmp_path, capsys):
    p = tmp_path / "t.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump(_trace(), f)
    trace_gaps.main([str(p), "--min-us", "1"])
    out = capsys.readouterr().out
    assert "host late 0.1 ms" in out and "FooBackward" in out and "k1 → k2" in out
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit) as e:
        trace_gaps.main([str(bad)])
    assert e.value.code == 2
    assert "trace: cannot read" in capsys.readouterr().err


def test_empty_trace():
    assert trace_gaps.analyse({"traceEvents": []})["span"] == 0.0
