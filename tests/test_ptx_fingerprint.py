"""tools/ptx_fingerprint.py: captured launches compile for sm_90 on the CPU, the same tree gives the
same fingerprints, and a changed launch is reported (exit status 1)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]

# the speculative-step and token-recurrent kernels of one dtype: a few small compiles
RUN = """
import sys
sys.path.insert(0, {root!r})
sys.argv = ["ptx_fingerprint"]
from tools import ptx_fingerprint as F
from gdn.ops import tuning
if {warps}:
    tuning.OTHER["recurrent"]["max_warps"] = {warps}
raise SystemExit(F.main(["--out", {out!r}, "--workloads", "recurrent float32", "--dtypes", "fp32"] + {extra!r}))
"""


def fingerprint(tmp_path, name, warps=0, extra=()):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = str(tmp_path / name)
    code = RUN.format(root=str(ROOT), out=out, warps=warps, extra=list(extra))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    return p, out


@pytest.mark.slow
def test_fingerprints_repeat_and_report_changes(tmp_path):
    p, first = fingerprint(tmp_path, "a.json")
    assert p.returncode == 0, p.stdout + p.stderr
    hashes = json.load(open(first))
    names = {json.loads(k)[0].rsplit(".", 1)[1] for k in hashes}
    assert {"_fused_recurrent_fwd_kernel", "_kda_fwd_kernel", "_kda_bwd_kernel", "_commit_kernel"} <= names, names
    p, _ = fingerprint(tmp_path, "b.json", extra=["--compare", first])
    assert p.returncode == 0 and " 0 differ, 0 new, 0 gone" in p.stdout, p.stdout + p.stderr
    p, _ = fingerprint(tmp_path, "c.json", warps=1, extra=["--compare", first])  # other warps: other launches
    assert p.returncode == 1 and "only in this run" in p.stdout, p.stdout + p.stderr


@pytest.mark.slow
def test_hopper_workloads_fingerprint_the_gluon_kernels(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = str(tmp_path / "h.json")
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); sys.argv = ['ptx_fingerprint']\n"
            "from tools import ptx_fingerprint as F\n"
            f"raise SystemExit(F.main(['--out', {out!r}, '--hopper', '--dtypes', 'bf16', '--workloads', "
            "'chunk bfloat16 g=True beta=True hopper']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    names = {json.loads(k)[0].rsplit(".", 1)[1] for k in json.load(open(out))}
    assert {"fused_fwd_kernel", "fused_rev_kernel", "fused_bwd_kernel"} <= names, names
