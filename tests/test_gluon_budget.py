"""tools/gluon_budget.py: the Gluon sketch of the fused backward's value loop compiles for sm_90 on
the CPU, and its resources follow its tiles (the figures docs/TRITON.md quotes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]

RUN = """
import json, sys
sys.path.insert(0, {root!r})
from tools import gluon_budget as G
print(json.dumps([G.resources(128, 128, bv, 8) for bv in (32, 64)]))
"""

KERNEL = """
import json, sys
sys.path.insert(0, {root!r})
from tools import gluon_budget as G
from gdn.ops.delta.triton.fused_bwd import value_tile
print(json.dumps([G.kernel_resources(K, V, value_tile(V), 8) for K, V in ((128, 128), (64, 256), (32, 96))]))
"""


def _run(code):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, never interpreted
    p = subprocess.run([sys.executable, "-c", code.format(root=str(ROOT))], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_value_loop_fits_eight_warps_without_spills():
    narrow, wide = _run(RUN)
    # five bf16 tiles a step in shared memory: three [64, BV] and two [128, BV]
    assert narrow["shared"] == (3 * 64 + 2 * 128) * 32 * 2 and wide["shared"] == 2 * narrow["shared"]
    # the five fp32 accumulators (2 · 64 · 64 + 3 · 64 · 128 values over 256 threads: 128 registers)
    # and the 32-wide tiles' loads fit without spilling
    assert narrow["spill"] == 0 and 128 < narrow["regs"] <= 255, narrow
    assert wide["regs"] >= narrow["regs"], (narrow, wide)


def test_fused_backward_kernel_compiles_within_its_budget():
    """gdn.ops.delta.triton.fused_bwd at its launch setting (8 warps, value tiles of 64, or 32 where
    64 does not divide V; a ring of two), bf16, specialised as the launcher specialises it: compiles
    for sm_90 in the card's shared memory (227 KB a block), without spilling at K = 64, V = 256 and
    at K = 32, V = 96; at K = V = 128 with 16 bytes of stack at most (ptxas: three scalars of the
    item's setup and epilogue, among them the chunk's rows of h and dh, stored once and loaded once
    an item; none in the value loop)."""
    wide, *rest = _run(KERNEL)
    assert wide["spill"] <= 16 and wide["regs"] <= 255 and wide["shared"] <= 227 * 1024, wide
    for r in rest:
        assert r["spill"] == 0 and r["regs"] <= 255 and r["shared"] <= 227 * 1024, r


ITEMS = """
import json, sys
sys.path.insert(0, {root!r})
from tools import gluon_budget as G
print(json.dumps([G.kernel_resources(128, 128, 64, 8, PER=p) for p in (1, 2)]))
"""


def test_fused_backward_items_a_program_hardly_spill():
    """Two items a program (``DELTA["fused_bwd"]["items"]``) at K = V = 128: each item in a branch of
    its own, so that no item's thread-indexed shared-memory addresses are reused, and held, by the
    next; with the first one outside a branch it spilled 512 bytes. 8 KB more shared memory (T⁻¹'s
    second slot), still in the card's."""
    one, two = _run(ITEMS)
    assert one["spill"] <= 16 and two["spill"] <= 32, (one, two)
    assert two["shared"] - one["shared"] >= 64 * 64 * 2 and two["shared"] <= 227 * 1024, (one, two)

FORWARD = """
import json, sys
sys.path.insert(0, {root!r})
from tools import gluon_budget as G
print(json.dumps([G.forward_resources(K, V, warm=w) for K, V, w in ((128, 128, False), (128, 128, True),
                                                                    (64, 64, True))]
                 + [G.forward_resources(K, V, warm=w, states=True) for K, V, w in ((128, 128, False),
                                                                                   (128, 128, True))]
                 + [G.forward_resources(128, 128, regs=(24, 120, 120))]))
"""


#: stack bytes of the warm-started forward at K = 128 (ptxas: 12 B stored, 20 loaded): values the
#: program's prologue forms before its partitions start, stored once there and loaded once at each
#: partition's start, outside every loop; as the launcher specialises the launch (16-byte aligned
#: pointers), which the compiles here do as well
WARM_STACK = 16


def test_warp_specialised_forward_compiles_without_spills():
    """gdn.ops.delta.triton.fused_fwd at its launch setting (the state, δ and output warpgroups and
    the copy warp; a ring of two), bf16: compiles for sm_90 without spilling at K = V = 128 (whole
    sequences; warm-started segments within WARM_STACK) and at K = V = 64, and as the backward's state pass, within
    the card's shared memory; the
    shared memory is the ring's tiles plus S, Y, δ, δ̃ and P (and the compiler's scratch for the
    output's layout conversion, under 16 KB); and the registers the
    setting gives the δ and output warpgroups are what they need: at 120 a thread they spill."""
    from gdn.ops.tuning import DELTA

    *fits, tight = _run(FORWARD)
    NS = DELTA["fused_fwd"]["NS"]
    for (K, V, warm), r in zip(((128, 128, False), (128, 128, True), (64, 64, True)), fits[:3]):
        assert r["spill"] <= WARM_STACK * (K == 128 and warm) and r["shared"] <= 227 * 1024, r
        tiles = NS * (2 * 64 * K + 64 * V + 64 * 64) * 2 + (K * V + 3 * 64 * V + 64 * 64) * 2
        assert tiles <= r["shared"] <= tiles + 16 * 1024, (r, tiles)
    # the backward's state pass (fused_states): no q or P tiles, no output warpgroup
    for r in fits[3:]:
        tiles = DELTA["fused_states"]["NS"] * (2 * 64 * 128 + 64 * 64) * 2 + (128 * 128 + 3 * 64 * 128) * 2
        assert r["spill"] == 0 and tiles <= r["shared"] <= tiles + 16 * 1024, (r, tiles)
    assert tight["spill"] > 0, tight


TILES = """
import json, sys
sys.path.insert(0, {root!r})
from tools import gluon_budget as G
print(json.dumps([G.forward_resources(K, 256, warm=w, states=s)
                  for K, w, s in ((128, False, False), (128, True, False), (64, True, False), (128, True, True))]
                 + [G.forward_resources(128, 128, VT=64, warm=True), G.forward_resources(128, 128, VT=64, states=True),
                    G.reverse_resources(128, 128, VT=64), G.reverse_resources(128, 128, VT=64, warm=True)]))
"""


def test_warp_specialised_forward_value_tiles_compile_without_spills():
    """fused_fwd at V = 256 (the 340m layer), each program on a 128-wide value tile of the head:
    compiles for sm_90 without spilling at the launch setting (K = 128 whole, and segmented within
    WARM_STACK; K = 64
    segmented, and as the backward's state pass), its shared memory the 128-wide tile's (ring,
    S, Y, δ, δ̃ and P as at V = 128, plus under 16 KB of the compiler's scratch); and the forward,
    state and reverse passes on 64-wide tiles of a 128-wide head."""
    from gdn.ops.tuning import DELTA

    VT = 128
    runs = _run(TILES)
    for (K, states, warm), r in zip(((128, False, False), (128, False, True), (64, False, True), (128, True, True)),
                                    runs):
        if states:
            tiles = DELTA["fused_states"]["NS"] * (64 * K + 64 * VT + 64 * 64) * 2 + (K * VT + 3 * 64 * VT) * 2
        else:
            tiles = (DELTA["fused_fwd"]["NS"] * (2 * 64 * K + 64 * VT + 64 * 64) * 2
                     + (K * VT + 3 * 64 * VT + 64 * 64) * 2)
        assert r["spill"] <= WARM_STACK * (K == 128 and warm and not states) and r["shared"] <= 227 * 1024, (K, r)
        assert tiles <= r["shared"] <= tiles + 16 * 1024, (K, states, r, tiles)
    # the passes on 64-wide value tiles of a 128-wide head (DELTA[name]["VT"] = 64): no spills, and
    # less shared memory than the 128-wide program's (forward segmented, the state pass, the reverse
    # pass whole and segmented)
    fwd, states, rev, rev_warm = runs[4:]
    assert all(r["spill"] == 0 for r in runs[4:]), runs[4:]
    assert fwd["shared"] < runs[1]["shared"] and states["shared"] < runs[3]["shared"], runs
    assert rev["shared"] <= rev_warm["shared"] < 200 * 1024, (rev, rev_warm)


PROBE = """
import json, sys
sys.path.insert(0, {root!r})
from tools import merged_probe as M
print(json.dumps([M.probe(), M.probe(regs=(24, 248, 248), maxnreg=248, on=(False, False))]))
"""


def test_merged_reverse_probe_counts_its_buffers():
    """tools/merged_probe.py: the probe of the reverse pass that does the per-chunk work compiles for
    sm_90; its shared memory is its thirteen buffers (q, k, dO, v, dδ, δ, Z, and V − ΓKS shared
    with dW at 16 KB, T, Pᵀ and M at 8, h and dS at 32: 216 KB, inside the 227 KB a program may
    take) and a few hundred bytes of barriers, and the chain's role alone needs no spills."""
    full, chain = _run(PROBE)
    assert 216 * 1024 <= full["shared"] < 217 * 1024, full
    assert full["regs"] == 128 and chain["regs"] == 248
    assert chain["spill"] == 0, chain


RBWD = """
import json, sys
sys.path.insert(0, {root!r})
from tools.gluon_budget import load_chains, rbwd_resources, sass


def measured(regs=None, **form):
    r = rbwd_resources(regs, cubin=True, **form)
    r["chain"] = max(load_chains(sass(r.pop("cubin"))))
    return r


print(json.dumps([measured(), measured(warm=False), measured((24, 192, 136)), measured(qk_b=True),
                  measured((24, 168, 160), dk_b=True)]))
"""


def test_merged_backward_compiles_within_shared_memory():
    """The merged backward kernel (fused_rbwd) compiles for sm_90 at its launch setting, in both
    forms, at another register split and with B forming dγ's pair terms or dK's terms through M,
    within the 227 KB of shared memory a program may take: its single-buffered tiles (q, k, dO, δ,
    dδ, Z, dÕ, dW at 16 KB; h and dS at 32; T, the pair terms and dA's two parts at 8) are 224 KB.
    Its stack stays small: its shared tiles are reached through an index that is zero but not
    provably so, which keeps the MMA operand descriptors inside the chunk loop (hoisted out
    of it, they spill 1.2 KB a thread at this setting, read back from L2 every chunk; 432 and 528
    B with the index). No role consumes global loads one after another as they land (the decay's
    column γ loaded per column did that, ten loads in a row, before it came from the rows')."""
    for r in _run(RBWD):
        assert 224 * 1024 <= r["shared"] <= 227 * 1024, r
        assert r["spill"] <= 640, r
        assert r["chain"] <= 2, r


def test_partition_counts_split_at_register_reallocations():
    """tools/gluon_budget.partition_counts: SASS lines counted per partition (the code before the
    first USETMAXREG, then from each one to the next), with HGMMA steps and spill stores and loads
    (predicated or not) told apart."""
    from tools.gluon_budget import partition_counts

    text = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;           /* 0x000 */",
        "        /*0010*/                   USETMAXREG.DEALLOC.CTAPOOL 0x18 ; /* 0x000 */",
        "        /*0020*/              @!P0 STL [R1+0x8], R2 ;              /* 0x000 */",
        "        /*0030*/                   USETMAXREG.ALLOC.CTAPOOL 0xc0 ;  /* 0x000 */",
        "        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ; /* 0x000 */",
        "        /*0050*/                   LDL.LU R4, [R1+0x8] ;            /* 0x000 */",
        "        /*0060*/                   LDL R5, [R1+0xc] ;               /* 0x000 */",
        "                                   (a line that is not an instruction)",
    ])
    c = partition_counts(text)
    assert [x["n"] for x in c] == [1, 2, 4]
    assert (c[1]["STL"], c[1]["LDL"], c[1]["HGMMA"]) == (1, 0, 0)
    assert (c[2]["STL"], c[2]["LDL"], c[2]["HGMMA"]) == (0, 2, 1)


def test_load_chains_count_loads_consumed_as_they_land():
    """tools/gluon_budget.load_chains: per partition, the longest run of global loads each read
    within a few instructions of its issue before the next load issues (the pattern ptxas gives
    many independent loads where registers are short); loads issued together and read later, or
    read only after the next load, do not count."""
    from tools.gluon_budget import load_chains

    def sass(lines):
        return "\n".join(f"        /*{16 * i:04x}*/                   {x} ;   /* 0x000 */" for i, x in enumerate(lines))

    chain = ["MOV R26, RZ", "@!P3 LDG.E R26, desc[UR60][R98.64]", "FADD R27, R26, -R77", "FMUL R27, R27, 1.44"]
    batch = ["LDG.E R6, desc[UR60][R8.64]", "LDG.E R7, desc[UR60][R10.64]", "LDG.E R9, desc[UR60][R12.64]",
             *["NOP"] * 9, "FADD R2, R6, R7", "FADD R3, R9, R2"]
    text = sass(["MOV R1, c[0x0][0x28]"] + batch + ["USETMAXREG.ALLOC.CTAPOOL 0xa8"] + chain * 3 + batch
                + ["USETMAXREG.ALLOC.CTAPOOL 0xa8"] + chain + ["NOP"] * 12 + ["LDG.E R4, desc[UR60][R2.64]"]
                + ["NOP"] * 12 + ["STG.E desc[UR60][R2.64], R4"])
    # before the first reallocation: a batch (none counted); then three loads in a row, each read
    # at once (3), then a batch; then one such load, and a load read only 13 instructions later
    assert load_chains(text) == [0, 3, 1]
    # with a wider window the batch's last load (read 11 instructions on) counts, and the late one
    assert load_chains(text, near=16) == [1, 3, 2]
