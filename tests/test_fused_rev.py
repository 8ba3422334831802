"""The warp-specialised reverse pass (gdn.ops.delta.triton.fused_rev) without a GPU: which kernels
the gated delta rule's backward launches on a Hopper card, recorded on the CPU
(gdn.ops.triton.launch.recording: nothing runs; the card's 132 multiprocessors assumed), and the
kernel compiled for sm_90 at its launch setting. Its results are checked on the GPU
(tests/gpu/test_fused_rev.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from gdn.ops import tuning  # noqa: E402
from gdn.ops.delta.triton import fused_bwd, fused_rev  # noqa: E402
from tests.test_fused_fwd_dispatch import SMS, _record, hopper  # noqa: E402, F401  (hopper: a fixture)


@pytest.fixture
def card(hopper, monkeypatch):
    """Launches as on a Hopper card for every Gluon pass: the backward's too."""
    for mod in (fused_bwd, fused_rev):
        monkeypatch.setattr(mod, "hopper", lambda q: True)


ROOT = Path(__file__).resolve().parents[1]


def _backward(B, T, H, HV, K, V, dtype=torch.bfloat16, h0=False):
    """The backward's launches, as (kernel name, grid, meta)."""
    return [(kernel.fn.__name__, grid, meta) for kernel, grid, _, meta in _record(B, T, H, HV, K, V, dtype, h0)[1]]


def test_the_reverse_pass_replaces_dv_local_and_state_bwd(card, monkeypatch):
    """(2, 512) at 4 heads: one launch over the (sequence, value head) programs, from the final-state
    gradient to the initial state's, then the per-chunk kernel."""
    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], slice_MB=0))
    names = [n for n, _, _ in _backward(2, 512, 4, 4, 128, 128, h0=True)]
    assert "dv_local_kernel" not in names and "state_bwd_kernel" not in names, names
    assert names.index("fused_rev_kernel") < names.index("fused_bwd_kernel"), names
    (grid, meta), = [(g, m) for n, g, m in _backward(2, 512, 4, 4, 128, 128, h0=True) if n == "fused_rev_kernel"]
    # 8 (sequence, value head) pairs: each on two programs of 64 value columns (plain_tile)
    assert grid == (2 * 4 * 2,) and meta["USE_DHT"] and meta["USE_INIT"] and meta["K"] == meta["V"] == 128, meta
    assert meta["VT"] == 64, meta


def _slices(mib: int, span: int) -> int:
    """Slices of a reverse pass whose dS_out of every chunk takes ``mib`` MiB (the budget's), over
    runs of ``span`` chunks (the longest sequence, or the warm-started segments' length): where
    ``share_h`` is on, the pass writes its dS_out into h's buffer (the first slice the budget's, then
    larger)."""
    from gdn.ops.triton.common import tail_sizes

    c = tuning.DELTA["state_bwd"]
    n = min(-(-mib // c["slice_MB"]), c["max_slices"])
    return len(tail_sizes(span, -(-span // n))) if c.get("share_h") else n


def _span(grid, B: int, T: int, HV: int, NVT: int = 1) -> int:
    """The chunks of the warm-started segments of a reverse pass launched on ``grid`` (segments ×
    HV × NVT programs) over B sequences of T tokens."""
    return -(-(T // 64) // (grid[0] // (HV * NVT) // B))


def test_slices_carry_the_state_gradient(card):
    """(8, 2048, 16, 128): dS_out of every chunk would take 128 MiB, over the budget: slices, last
    first, each the pass then the per-chunk kernel over its chunks; the carried dS is written by
    every slice but the last (the sequences' first chunks: no initial state here) and read by every
    slice but the first."""
    launches = _backward(8, 2048, 16, 16, 128, 128)
    names = [n for n, _, _ in launches]
    rev = [(g, m) for n, g, m in launches if n == "fused_rev_kernel"]
    n = _slices(128, 32)  # (the plain pass: whole sequences of 32 chunks)
    assert n > 1 and len(rev) == n and "state_bwd_kernel" not in names and "dv_local_kernel" not in names, names
    assert [n for n in names if n in ("fused_rev_kernel", "fused_bwd_kernel")] == ["fused_rev_kernel",
                                                                                 "fused_bwd_kernel"] * n, names
    assert [m["USE_DHT"] for _, m in rev] == [False] + [True] * (n - 1), rev
    assert [m["USE_INIT"] for _, m in rev] == [True] * (n - 1) + [False], rev
    assert all(g == (8 * 16,) for g, _ in rev), rev


def test_few_long_sequences_run_as_segments_slice_by_slice(card):
    """1 × 32768 at 16 heads: 16 programs would leave the card idle; warm-started segments give at
    most one program a multiprocessor, each warm-up count (after the segment) from warm_plan. Their
    dS_out of every chunk would take 256 MiB, over the budget: the segments run slice by slice,
    tails first, each slice then the per-chunk kernel over its chunks; the first slice warm-started,
    storing the dS entering each program (``CARRY``), the later ones starting from it."""
    launches = _backward(1, 32768, 16, 16, 128, 128, h0=True)
    names = [n for n, _, _ in launches]
    assert "state_bwd_kernel" not in names and "dv_local_kernel" not in names, names
    rev = [(g, m) for n, g, m in launches if n == "fused_rev_kernel"]
    n = _slices(256, _span(rev[0][0], 1, 32768, 16))
    assert n > 1 and len(rev) == n and [x for x in names if x in ("fused_rev_kernel", "fused_bwd_kernel")] == [
        "fused_rev_kernel", "fused_bwd_kernel"] * n, names
    (grid, meta), rest = rev[0], rev[1:]
    assert meta["WARM"] and meta["CARRY"] and meta["USE_DHT"] and meta["USE_INIT"], meta
    assert SMS // 2 < grid[0] <= SMS, grid
    assert all(g == grid and not m["WARM"] and not m["CARRY"] and m["USE_DHT"] and m["USE_INIT"] for g, m in rest), rest
    plans = [m for n, _, m in launches if n == "warm_plan_kernel"]
    assert plans[-1]["AFTER"] and names.index("warm_plan_kernel", names.index("fused_fwd_kernel")) < names.index(
        "fused_rev_kernel"), names


def test_half_the_card_runs_as_segments_slice_by_slice(card):
    """(4, 8192) at 16 heads: 64 programs, half the card: warm-started segments (one program a
    multiprocessor), and as all 512 chunks' dS_out would take 256 MiB, slice by slice."""
    launches = _backward(4, 8192, 16, 16, 128, 128)
    rev = [(g, m) for n, g, m in launches if n == "fused_rev_kernel"]
    assert len(rev) == _slices(256, _span(rev[0][0], 4, 8192, 16)) and rev[0][1]["WARM"] and rev[0][1]["CARRY"], [
        n for n, _, _ in launches]
    assert all(SMS // 2 < g[0] <= SMS for g, _ in rev) and not any(m["WARM"] for _, m in rev[1:]), rev


def test_value_heads_of_256_run_as_two_value_tiles(card, monkeypatch):
    """(2, 512) at 4 heads of V = 256: one program per (sequence, value head, 128-wide value tile),
    the two tiles of a head neighbours in the grid; dO read and dh written in [64, 128] and
    [K, 128] blocks of the whole [·, V]-wide rows."""
    monkeypatch.setitem(tuning.DELTA, "state_bwd", dict(tuning.DELTA["state_bwd"], slice_MB=0))
    monkeypatch.setitem(tuning.DELTA, "fused_rev", dict(tuning.DELTA["fused_rev"], narrow=0))
    B, T, HV, K, V = 2, 512, 4, 128, 256
    launches = _record(B, T, 4, HV, K, V, h0=True)[1]
    names = [kernel.fn.__name__ for kernel, _, _, _ in launches]
    assert "dv_local_kernel" not in names and "state_bwd_kernel" not in names, names
    (grid, a), = [(grid, dict(zip(kernel.arg_names, args)) | meta) for kernel, grid, args, meta in launches
                  if kernel.fn.__name__ == "fused_rev_kernel"]
    assert grid == (B * HV * 2,) and a["USE_DHT"] and a["USE_INIT"] and not a["WARM"], (grid, a)
    assert (a["K"], a["V"], a["VT"]) == (128, 256, 128), a
    assert a["do_t"].block_shape == [64, 128] and list(a["do_t"].shape) == [B * T, HV * V], a["do_t"]
    assert a["dh_t"].block_shape == [K, 128] and list(a["dh_t"].shape) == [B * T // 64 * HV * K, V], a["dh_t"]
    assert fused_rev.value_tiles(64) == fused_rev.value_tiles(128) == 1 and fused_rev.value_tiles(256) == 2


def test_unsplit_passes_that_leave_half_the_card_idle_run_on_narrower_tiles(card, monkeypatch):
    """plain_tile: (4, 8192, 16, 128) with the split off, sliced, has 64 (sequence, value head)
    pairs: each runs as two programs of 64 value columns (128 programs, one wave of 132), dO read
    and dh written in [64, 64] and [K, 64] blocks; (8, 2048, 16, 128) has 128 pairs, which would
    take two waves so: 128-wide. The backward's recomputed state pass keeps its own tile
    (``fused_states``)."""
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], L=0))
    launches = _record(4, 8192, 16, 16, 128, 128)[1]
    rev = [(grid, dict(zip(kernel.arg_names, args)) | meta) for kernel, grid, args, meta in launches
           if kernel.fn.__name__ == "fused_rev_kernel"]
    assert len(rev) == _slices(256, 128) and all(g == (4 * 16 * 2,) and not a["WARM"] for g, a in rev), rev
    a = rev[0][1]
    assert (a["V"], a["VT"]) == (128, 64) and a["do_t"].block_shape == [64, 64] and a["dh_t"].block_shape == [128, 64]
    states = [m for kernel, _, _, m in launches if kernel.fn.__name__ == "fused_fwd_kernel"]
    assert states and all(m["VT"] == 128 for m in states), states
    rev = [(g, m) for n, g, m in _backward(8, 2048, 16, 16, 128, 128) if n == "fused_rev_kernel"]
    assert rev and all(g == (8 * 16,) and m["VT"] == 128 for g, m in rev), rev
    monkeypatch.setitem(tuning.DELTA, "fused_rev", dict(tuning.DELTA["fused_rev"], narrow=0))
    rev = [(g, m) for n, g, m in _backward(4, 8192, 16, 16, 128, 128) if n == "fused_rev_kernel"]
    assert all(g == (4 * 16,) and m["VT"] == 128 for g, m in rev), rev
    assert fused_rev.value_tiles(128) == 1 and fused_rev.plain_tile(128, 64, torch.device("cpu")) == 128


def test_value_heads_of_256_split_counting_every_tile(card):
    """1 × 32768 at 16 heads of V = 256: 32 programs; the segments keep at most one program a
    multiprocessor counting both value tiles, and warm_plan runs once per (segment, head), its
    counts shared by the head's value tiles (the first, warm-started slice of the sliced pass)."""
    launches = _backward(1, 32768, 16, 16, 128, 256, h0=True)
    (grid, meta), *_ = [(g, m) for n, g, m in launches if n == "fused_rev_kernel"]
    assert meta["WARM"] and SMS // 2 < grid[0] <= SMS, (grid, meta)
    plan_grid = [g for n, g, _ in launches if n == "warm_plan_kernel"][-1]
    assert grid[0] == plan_grid[0] * plan_grid[1] * 2 and plan_grid[1] == 16, (grid, plan_grid)


def test_value_tiles_count_towards_filling_the_card_sliced(card):
    """(2, 8192) at 16 heads of V = 256: the 2 · 16 · 2 = 64 programs (counting the 128-wide value
    tiles) run as two warm-started segments a sequence (128 programs: one a multiprocessor), and
    as dS_out of every chunk would take 256 MiB, slice by slice."""
    launches = _backward(2, 8192, 16, 16, 128, 256)
    rev = [(g, m) for n, g, m in launches if n == "fused_rev_kernel"]
    assert len(rev) == _slices(256, _span(rev[0][0], 2, 8192, 16, 2)) and rev[0][1]["WARM"], [n for n, _, _ in launches]
    assert all(g == (2 * 2 * 16 * 2,) and m["VT"] == 128 for g, m in rev), rev


def test_usable_value_widths(card):
    q = torch.empty(4, 2, 128, dtype=torch.bfloat16)
    g = beta = torch.zeros(4, 2)
    for V in (64, 128, 256):
        assert fused_rev.usable(q, g, beta, 128, V) and fused_rev.usable(q, g, beta, 64, V), V
    for K, V in ((128, 32), (128, 512), (128, 192), (256, 128), (256, 256), (32, 128)):
        assert not fused_rev.usable(q, g, beta, K, V), (K, V)


def test_chained_split_and_calls_it_does_not_take_keep_the_triton_passes(card, monkeypatch):
    for K, V, dtype in ((256, 256, torch.bfloat16), (128, 512, torch.bfloat16), (128, 128, torch.float32),
                        (256, 128, torch.bfloat16)):
        names = [n for n, _, _ in _backward(2, 256, 2, 2, K, V, dtype)]
        assert "fused_rev_kernel" not in names and "state_bwd_kernel" in names, (K, V, dtype, names)
    # a chained split (an explicit segment length without the warm start): state_bwd's AUG form
    monkeypatch.setitem(tuning.DELTA, "split", dict(tuning.DELTA["split"], L=4, warm=False))
    names = [n for n, _, _ in _backward(1, 2048, 2, 2, 128, 128)]
    assert "fused_rev_kernel" not in names and "chain_kernel" in names, names


def test_off_switch(card, monkeypatch):
    monkeypatch.setitem(tuning.DELTA, "fused_rev", dict(tuning.DELTA["fused_rev"], on=False))
    names = [n for n, _, _ in _backward(2, 512, 4, 4, 128, 128)]
    assert "fused_rev_kernel" not in names and "state_bwd_kernel" in names and "dv_local_kernel" in names, names


COMPILE = """
import json, sys
sys.path.insert(0, {root!r})
from tools import gluon_budget as G
print(json.dumps([G.reverse_resources(K, V, warm=w) for K, V, w in ((128, 128, False), (128, 128, True),
                                                                    (64, 64, True), (128, 64, False),
                                                                    (128, 256, False), (128, 256, True),
                                                                    (64, 256, True))]
                 + [G.reverse_resources(128, 128, warm=True, carry=True)]
                 + [G.reverse_resources(128, 128, regs=(24, 152, 152))]))
"""


def test_compiles_without_spills_in_shared_memory():
    """sm_90 at the launch setting: no spills at K = V = 128 (whole sequences, warm-started segments
    and the first slice of sliced ones), the narrower heads and V = 256 (each program on a
    128-wide value tile: K = 128 whole
    and segmented, K = 64 segmented, its shared memory the V = 128 program's), within the
    card's 227 KB of shared memory; the ring's tiles (q, k, dO, T in two slots) and the handed ones
    (dS, Pᵀ, L, dδ, Z, dÕ) are most of it; the local warpgroup needs the registers the setting gives
    it (at 152 a thread it spills)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", COMPILE.format(root=str(ROOT))], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    *fits, tight = json.loads(p.stdout.strip().splitlines()[-1])
    NS = tuning.DELTA["fused_rev"]["NS"]
    tiles = NS * (2 * 64 * 128 + 64 * 128 + 64 * 64) * 2 + (128 * 128 + 64 * 64 + 4 * 64 * 128) * 2
    assert tiles <= fits[0]["shared"] <= 227 * 1024, (tiles, fits[0])
    assert all(r["spill"] == 0 for r in fits), fits
    assert fits[4]["shared"] == fits[0]["shared"] and fits[5]["shared"] == fits[1]["shared"], fits
    assert fits[7]["shared"] == fits[1]["shared"], fits
    assert tight["spill"] > 0, tight
