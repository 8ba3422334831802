"""tools/sass_cpu.py: with ``--hopper`` the recorded launches are the H200's own (its Gluon passes
and fused backward beside kkt_solve), each compiled for sm_90 on the CPU into a row of registers,
spills and shared memory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")
ROOT = Path(__file__).resolve().parents[1]


def _rows(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, never interpreted
    p = subprocess.run([sys.executable, "tools/sass_cpu.py", *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return {line.split("|")[1].strip(): line for line in p.stdout.splitlines() if line.startswith("| ") and "_kernel" in line}


def test_hopper_records_the_gluon_kernels():
    rows = _rows("--shape", "1x256", "--h", "2", "--hopper", "--kernels", "kkt_solve,fused_fwd,fused_bwd")
    assert set(rows) == {"kkt_solve_kernel", "fused_fwd_kernel", "fused_bwd_kernel"}, rows
    regs = int(rows["fused_bwd_kernel"].split("|")[6])
    assert 128 < regs <= 255, rows["fused_bwd_kernel"]
    # the warp-specialised pass's worker warps count towards occupancy: 4 launched, 12 or 16 run
    warps = rows["fused_fwd_kernel"].split("|")[4].strip()
    assert warps.startswith("4 (") and int(warps[3:-1]) > 4, warps
    # names with their _kernel suffix pick the same kernels
    plain = _rows("--shape", "1x256", "--h", "2", "--kernels", "kkt_solve_kernel,fused_fwd,fused_bwd_kernel")
    assert set(plain) == {"kkt_solve_kernel"}, plain  # a card without the Gluon kernels


def test_hopper_splits_as_the_card_would():
    """Every module that sizes a grid or splits sequences sees the H200's 132 multiprocessors: at
    1 × 4096 and 4 heads the sequential passes run as warm-started segments (their warm-up counts
    from warm_plan, over the bounds kkt_solve stores) rather than as the four programs the CPU's
    count would leave whole."""
    rows = _rows("--shape", "1x4096", "--h", "4", "--hopper", "--kernels", "warm_plan,fused_fwd,bound")
    assert "warm_plan_kernel" in rows and "bound_kernel" not in rows, rows
    grid = int(rows["fused_fwd_kernel"].split("|")[11])
    assert grid > 4, rows["fused_fwd_kernel"]


def test_kda_kernels_hold_no_spills_in_bf16():
    """Every KDA chunk kernel of a forward + backward at K = V = 128 in bf16, at its launch settings
    (register caps included), compiles for sm_90 with no stack and no spills (docs/KDA.md,
    "Spill-free at the timed settings")."""
    rows = _rows("--shape", "8x2048", "--op", "kda")
    assert {"state_fwd_kernel", "state_bwd_kernel", "intra_bwd_kernel", "kkt_kernel"} <= set(rows), rows
    for name, line in rows.items():
        cells = [c.strip() for c in line.split("|")]
        assert cells[7] == "0" and cells[8] == "0/0", line
