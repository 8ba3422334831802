"""Per-kernel GPU time of this tree against another (a base commit's), in one device call: runs a
benchmark's per-kernel profile (default ``benchmarks/ops_gpu.py --peers gdn --shapes 2,6,0
--only-profile``) in each tree in turn, the two alternating over ``--rounds`` rounds (new, base,
base, new, ...: a drifting card or host weighs on both alike), and prints per profile block a table
of each kernel's µs per call in every run, the median of each tree and their ratio.

    git worktree add -f .ab-base <commit> --detach          # on the development machine
    python3 tools/ab_trees.py --base .ab-base [--rounds 2]
    python3 tools/ab_trees.py --base .ab-base -- benchmarks/ops_gpu.py --peers gdn --shapes 2 \
        --profile --variants '[{}, {"fused_bwd": {"items": 2}}]'
    python3 tools/ab_trees.py --base .ab-base -- benchmarks/kda_gpu.py --profile --shapes 0 --no-fla

(the base tree is ignored by git: name it in the device call's carry). Any script whose profile
blocks read "LABEL, µs per call (total N µs):" followed by "  µs  xCOUNT  KERNEL" lines
(benchmarks/ops_gpu.py's ``kernel_times``) will do. Each run imports the tree's own ``gdn``
(PYTHONPATH set to it ahead of what the environment holds). A run that fails is reported with its
exit status and the end of its output; the others still print.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^(\S.*?), µs per call \(total (\d+) µs\):$")
_KERNEL = re.compile(r"^\s+([\d.]+)\s+x(\d+)\s+(.+)$")
DEFAULT = ["benchmarks/ops_gpu.py", "--peers", "gdn", "--shapes", "2,6,0", "--only-profile"]


def parse(text: str) -> dict:
    """{label: {kernel: µs per call, ..., "total": µs}} of the per-kernel profile blocks in ``text``
    (the label as printed: implementation, shape, variant where there is one, and pass)."""
    out: dict = {}
    cur = None
    for line in text.splitlines():
        m = _BLOCK.match(line)
        if m:
            cur = out.setdefault(m.group(1), {})
            cur["total"] = float(m.group(2))
            continue
        m = _KERNEL.match(line) if cur is not None else None
        if m:
            name = m.group(3).strip()
            cur[name] = cur.get(name, 0.0) + float(m.group(1))
        elif cur is not None and line.strip():
            cur = None
    return out


def table(label: str, new: list[dict], base: list[dict]) -> str:
    """A markdown table of one label's kernels: µs per call in each run of each tree, the medians'
    ratio new / base (below 1: the new tree is faster); kernels by the base's median, longest first,
    the total last."""
    names = {k for r in new + base for k in r if k != "total"}

    def med(runs, k):
        xs = [r[k] for r in runs if k in r]
        return statistics.median(xs) if xs else float("nan")

    def longest(k):
        b = med(base, k)
        return -(med(new, k) if math.isnan(b) else b)  # (a kernel the base does not run: the new tree's)

    order = sorted(names, key=longest)
    head = (f"\n{label}\n\n| kernel | " + " | ".join(f"new {i + 1}" for i in range(len(new)))
            + (" | " if new and base else "") + " | ".join(f"base {i + 1}" for i in range(len(base)))
            + " | new / base |\n|---|" + "---|" * (len(new) + len(base) + 1))
    rows = []
    for k in order + ["total"]:
        cells = [f"{r[k]:.1f}" if k in r else "-" for r in new + base]
        a, b = med(new, k), med(base, k)
        ratio = f"{a / b:.3f}" if not (math.isnan(a) or math.isnan(b)) and b > 0 else "-"
        rows.append(f"| {'**total**' if k == 'total' else k} | " + " | ".join(cells) + f" | {ratio} |")
    return head + "\n" + "\n".join(rows)


def run_tree(tree: Path, cmd: list[str], timeout: float) -> tuple[int, str]:
    """(exit status, stdout + stderr) of ``python3 cmd...`` (a script of the tree and its arguments)
    run in ``tree``, its gdn first on the import path; 124 where it ran past ``timeout`` seconds."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    try:
        p = subprocess.run([sys.executable, *cmd], cwd=tree, env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out
    return p.returncode, p.stdout + p.stderr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other tree (a worktree of the base commit)")
    ap.add_argument("--new", default=str(ROOT), help="the tree under test (default: this one)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tree (default 2)")
    ap.add_argument("--timeout", type=float, default=150, help="seconds a run may take (default 150)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER,
                    help=f"after --: the script (a path in the trees) and its arguments (default: {' '.join(DEFAULT)})")
    a = ap.parse_args(argv)
    cmd = (a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd) or DEFAULT
    if a.rounds < 1:
        ap.error(f"--rounds must be positive, got {a.rounds}")
    trees = {"new": Path(a.new).resolve(), "base": Path(a.base).resolve()}
    for name, tree in trees.items():
        if not (tree / cmd[0]).is_file():
            ap.error(f"--{name} {tree}: no {cmd[0]} there (expected a tree of this repository)")
    runs: dict = {"new": [], "base": []}
    for r in range(a.rounds):
        for name in (("new", "base") if r % 2 == 0 else ("base", "new")):
            rc, out = run_tree(trees[name], cmd, a.timeout)
            if rc != 0:
                tail = "\n".join(out.strip().splitlines()[-8:])
                print(f"{name} run {r + 1}: exit status {rc}\n{tail}", flush=True)
            runs[name].append(parse(out))
    labels = list(dict.fromkeys(k for rs in (runs["new"], runs["base"]) for p in rs for k in p))
    if not labels:
        print("no per-kernel profile in any run's output")
        return 1
    for label in labels:
        print(table(label, [p[label] for p in runs["new"] if label in p],
                    [p[label] for p in runs["base"] if label in p]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
