"""tools/ab_trees.py: ops_gpu.py's per-kernel profile run in two trees in turn and set side by side.
The trees here are stand-ins whose ops_gpu.py prints a canned profile (the real one needs CUDA)."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import ab_trees  # noqa: E402

from .run_tool import run_tool  # noqa: E402

SAMPLE = """
launch configuration overrides: none

gdn kernels at (8, 2048, 16, 128), fwd+bwd, µs per call (total 910 µs):
      450.0  x3   fused_bwd_kernel
      200.5  x3   fused_rev_kernel
      100.0  x2   fused_fwd_kernel
gdn host ms at (8, 2048, 16, 128): fwd 0.2, fwd+bwd 1.1

gdn KDA at 1 x 32768, forward+backward, µs per call (total 1800 µs):
      886.0  x1   fused_bwd_kernel
"""


def test_parse_reads_each_block_and_stops_at_its_end():
    p = ab_trees.parse(SAMPLE)
    a, b = "gdn kernels at (8, 2048, 16, 128), fwd+bwd", "gdn KDA at 1 x 32768, forward+backward"
    assert list(p) == [a, b]
    assert p[a] == {"total": 910.0, "fused_bwd_kernel": 450.0, "fused_rev_kernel": 200.5, "fused_fwd_kernel": 100.0}
    assert p[b] == {"total": 1800.0, "fused_bwd_kernel": 886.0}


def test_table_gives_medians_ratio_and_marks_a_missing_kernel():
    new = [{"total": 900.0, "a": 400.0}, {"total": 920.0, "a": 420.0}]
    base = [{"total": 1000.0, "a": 500.0, "b": 10.0}]
    t = ab_trees.table("shape", new, base)
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in t.splitlines() if r.startswith("| ")}
    assert rows["a"] == ["400.0", "420.0", "500.0", "0.820"]
    assert rows["b"] == ["-", "-", "10.0", "-"]
    assert rows["**total**"] == ["900.0", "920.0", "1000.0", "0.910"]
    assert list(rows)[1:] == ["a", "b", "**total**"]  # longest first (after the header)


def _fake_tree(root: Path, fused_bwd_us: float, fail: bool = False, script: str = "ops_gpu.py",
               needs: str = "--only-profile") -> Path:
    (root / "benchmarks").mkdir(parents=True, exist_ok=True)
    body = "import sys\nsys.exit(3)\n" if fail else textwrap.dedent(f"""
        import sys
        assert "{needs}" in sys.argv, sys.argv
        print("gdn kernels at s, fwd+bwd, µs per call (total {fused_bwd_us + 100:.0f} µs):")
        print("      {fused_bwd_us:.1f}  x1   fused_bwd_kernel")
        print("      100.0  x1   fused_rev_kernel")
        """)
    (root / "benchmarks" / script).write_text(body)
    return root


def test_two_trees_alternate_and_a_failing_run_is_reported(tmp_path):
    new, base = _fake_tree(tmp_path / "new", 400.0), _fake_tree(tmp_path / "base", 500.0)
    res = run_tool("ab_trees.py", "--new", str(new), "--base", str(base), "--rounds", "2", timeout=120)
    assert res.returncode == 0, res.stderr
    line = [r for r in res.stdout.splitlines() if r.startswith("| fused_bwd_kernel")][0]
    assert [c.strip() for c in line.split("|")[2:-1]] == ["400.0", "400.0", "500.0", "500.0", "0.800"], line
    bad = _fake_tree(tmp_path / "bad", 0.0, fail=True)
    res = run_tool("ab_trees.py", "--new", str(new), "--base", str(bad), "--rounds", "1", timeout=120)
    assert res.returncode == 0 and "base run 1: exit status 3" in res.stdout, res.stdout + res.stderr
    assert "| fused_bwd_kernel | 400.0 | - |" in res.stdout, res.stdout


def test_another_script_after_the_separator(tmp_path):
    trees = [_fake_tree(tmp_path / n, us, script="kda_gpu.py", needs="--no-fla") for n, us in (("n", 300.0), ("b", 200.0))]
    res = run_tool("ab_trees.py", "--new", str(trees[0]), "--base", str(trees[1]), "--rounds", "1", "--",
                   "benchmarks/kda_gpu.py", "--profile", "--no-fla", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| fused_bwd_kernel | 300.0 | 200.0 | 1.500 |" in res.stdout, res.stdout


def test_a_base_that_is_not_a_tree_is_a_usage_error(tmp_path):
    res = run_tool("ab_trees.py", "--base", str(tmp_path))
    assert res.returncode == 2 and "expected a tree of this repository" in res.stderr and "Traceback" not in res.stderr
