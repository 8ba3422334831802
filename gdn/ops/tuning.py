"""Every kernel's launch settings, in one table, and the rules that size their tiles.

This module imports neither Triton nor the kernels: it is the one place to read or change how a
kernel launches. The chunk kernels launch through :func:`gdn.ops.triton.launch.launch`, which
takes ``num_warps`` and the candidates ``stages`` of the kernel's entry here and picks one
candidate per launch (the rule is in that function's docstring); the other kernels read their
tiles and warps from the entries and rules below.

Entry keys: ``num_warps``; ``stages``, the software-pipelining depths tried, each an int or a
pair (depth, form), a form being compile-time switches of the kernel; ``waves`` (pick the
candidate whose grid runs in the fewest waves, for the sequential passes); ``BK``/``BV``, the
K and V tiles; ``SV``, the fp32 elements of one K × BV state tile of a sequential pass;
``BV_min``, the narrowest value tile a pass may halve down to. Every value was chosen on an
H200 with triton 3.6 by ``tools/tune_gpu.py`` (the candidates were within ±5 % of each other at
K = V = 128 bf16) unless its comment says why it differs.
"""
from __future__ import annotations

import copy
import json
import os

#: Triton's CPU interpreter runs the kernels (``TRITON_INTERPRET=1``): smaller blocks keep it fast,
#: and the sequential passes loop with ``while`` (it cannot run ``for`` with run-time bounds).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: Chunk size of every chunk kernel (tokens); also the size of the in-chunk triangular solve.
BT = 64

#: Smallest K and V the chunk kernels see: narrower heads are zero-padded to it. Triton 3.6 on the
#: H200 miscompiles dots whose K or V operand is 16 wide in the scalar kernels; the sequential
#: passes' value tiles may still be narrower (BV_min), where the GPU tests pass.
MIN_DIM = 32
#: Largest K and V of the KDA chunk kernels and of the token-recurrent kernels (one K × BV tile).
MAX_HEAD_DIM = 256
#: Calls without gradients of at most this many tokens (the whole packed stream) run the
#: token-recurrent kernels: below it the sequential kernel beats the chunk pipeline.
RECURRENT_MAX_T = 64

#: The scalar-gate (delta family) chunk kernels.
DELTA = {
    # INV is the precision of the in-chunk inverse's fp32 dots for half inputs ("ieee": FMA, exact
    # fp32; "tf32x3": three tensor-core passes; "tf32": one); fp32 inputs always take "ieee". "tf32"
    # makes the forward 7–37 % faster on the H200 and moves results by ≈ 2e-3 relative (half of
    # what bf16 inputs cost), within tier 3 at every case of tests/gpu. Two stages: 188 → 151 µs
    # at (4, 8192, 16, 128); three: 113 → 105 µs at (8, 2048), 217 → 202 at (4, 8192), outputs
    # identical bit for bit (docs/BENCHMARKS.md).
    # fp32 inputs: K tiles of 16 at one stage (ptxas, sm_90, (8, 2048): no spills, 255 registers;
    # BK = 64 at three stages spilled 2716 + 2700 B, BK = 32 at one stage 120 + 140; not timed)
    # One warp (16-bit inputs): ptxas sm_90 208 registers, no spills, nine programs a multiprocessor
    # and no barriers across warps in the block solve, against 179 registers and five at two warps;
    # H100, GPU µs 148 → 100 at 1 × 32768, 558 → 361 at Qwen3.5-397B, 149 → 101 packed, 77 → 55 at
    # (8, 2048) (register caps at two warps: 168 → 138 µs at 1 × 32768, 144 → 155; ops_gpu.py
    # --variants, 2026-12-05). fp32 inputs keep two warps (one was not timed for them).
    "kkt_solve": dict(num_warps=1, stages=(3, 2, 1), BK=64, BV=64, INV="tf32", fp32=dict(BK=16, stages=(1,), num_warps=2)),
    # 8 warps: with 4, triton 3.6 on the H200 compiles an out-of-range shared-memory access at
    # K = 60/64, T = 63 (compute-sanitizer); 8 warps time the same.
    "wu": dict(num_warps=8, stages=(3, 2, 1), BK=64, BV=64),
    # The value tile halves (down to BV_min) while the (sequence, head, tile) programs would not
    # fill the card (chunk_fwd.state_tile): (1, 32768, 16, 128) forward 1.78 → 1.63 ms.
    # from_inverse (delta members; read by the forward's two-stage pass; the backward's recompute
    # follows state_bwd's from_inverse, since its reverse pass reads W unless that is set): δ = T⁻¹ diag(β)(V − diag(Γ) K S)
    # formed in the pass from the in-chunk inverse, v and β, so the forward runs no wu kernel and
    # stores no W or U; one more [64, 64] × [64, BV] product per chunk step. H200 forward kernels at
    # (8, 2048): 422 → 346 µs; (1, 8192, HV = 32): 498 → 443 µs (docs/TRITON.md).
    "state_fwd": dict(num_warps=4, stages=(3, 2, 1), waves=True, SV=8192, BV_min=16, from_inverse=True, TMA=False),
    # The forward's fused state-and-output pass, taken when its programs number at least ``fill``
    # times the multiprocessors (delta.triton.chunk.layout); else state_fwd then output. Two stages
    # only: with a third the GPU tests fail at T = 63, V = 16 bf16; at one (which the fewest-waves
    # rule took at K = V = 256 and for fp32) the bf16 forward faults on the H200 (illegal memory
    # access at (8, 2048, 16, 128) and (8, 2048, 16, 256); docs/TRITON.md). from_inverse: as
    # state_fwd's.
    # TMA: q, k, v and T⁻¹ read by bulk tensor copies (descriptors) instead of per-thread loads.
    # Delta members: kkt_solve stores each chunk's Q Kᵀ ⊙ D and the pass reads it instead of forming
    # it per value tile (chunk_fwd.forward): forward kernels at (8, 2048) 337 → 298 µs, forward at
    # (4, 8192) 0.663 → 0.573 ms and at (1, 32768, HV = 64) 2.540 → 2.196 ms (docs/TRITON.md).
    "state_out": dict(num_warps=4, stages=(2,), waves=True, SV=4096, fill=1.5, BV_min=32, from_inverse=True,
                      TMA=False),
    "output": dict(num_warps=4, stages=(1,), BK=128, BV=64),
    # Pipelined loops over value/key blocks, GPU µs at (4, 8192, 16, 128): dv_local 170 → 158 with
    # three stages, dqk 920 → 742 with two (→ 700 with three at 1 × 32768), wy_bwd 599 → 569 with three.
    "dv_local": dict(num_warps=8, stages=(3, 2, 1), BK=64, BV=128),
    # Value tiles as state_fwd's; depth and form by waves: the plain kernel or QS (the row scale on
    # Q: 4 KB less shared memory for a [64, K] scaling per step), which saves a wave at (4, 8192)
    # (446 against 568 µs) and is slower where it saves none. Never the plain kernel at one stage:
    # triton 3.6 miscompiles it on the H200 (wrong dh0, dk, dv; an illegal access at K = V = 256).
    # from_inverse (delta members): the backward runs no wu and keeps no W or U; its recomputed
    # state pass forms δ from T⁻¹ (as state_fwd's from_inverse) and this pass forms Wᵀ dδ as
    # Kᵀ diag(βΓ) (Tᵀ dδ), one more [64, 64] × [64, BV] product per chunk step. H200 fwd+bwd:
    # (4, 8192) 2.867 → 2.627 ms, Qwen3.5-397B 12.533 → 11.672 (docs/TRITON.md).
    # slice_MB (0: never): where dS_out of every chunk would take more than this, the reverse pass
    # and the per-chunk stage run slice by slice (chunk_bwd.backward), dh holding one slice's
    # chunks (with share_h below, in h's buffer: the first slice's chunks). 44: (8, 2048, 16, 128)
    # with a buffer of a third of its dS_out (three slices; two with share_h), its forward+backward
    # peak 0.48 → 0.46 GiB (H200, ops_gpu.py --variants; four slices instead of six at (4, 8192) kept 0.88 against
    # 0.87 GiB, 2.167 against 2.228 ms). max_slices caps the count: each slice costs ≈ 22 µs of GPU
    # time (the per-chunk kernel's last wave, the reverse chain's pipeline filling again) and two or
    # three launches, while the backward holds h whole, as large as dh unsliced, so a quarter of dh
    # is already small beside it (Qwen3.5-397B: four slices of 256 MiB rather than 24 of 43, peak
    # 4.27 → 3.53 GiB at 8.33 → 8.40 ms; (8, 2048): 0.53 → 0.46 GiB at 1.43 → 1.71 ms, the
    # slices' launches on the host, which the forward+backward of one op waits for). The
    # warm-started split is sliced within its segments, tails first, the dS entering each slice
    # carried to the next, so each segment walks its warm-up once (cutting the token stream into
    # runs with warm-started segments of their own walked every warm-up again: 1 × 32768 at 2.59–
    # 2.93 ms instead of 1.92). H200, one process, unsliced → four slices (fwd+bwd ms, peak GiB):
    # 1 × 32768 1.910, 1.07 → 2.015, 0.89; HV = 32 at 1 × 8192 1.606, 0.53 → 1.745, 0.46; packed
    # 12 sequences 2.069, 1.07 → 2.265, 0.94. With the split sliced too, the reverse pass splits
    # wherever split_len would (it ran sliced and unsplit where the programs filled a quarter of
    # the card): (4, 8192) 2.039 → 2.004 ms at 0.88 → 0.89 GiB, Qwen3.5-397B 7.796 → 7.485 at
    # 3.53, the 340m layer 1.565 → 1.390 (docs/BENCHMARKS.md).
    # share_h: the sliced pass cuts every sequence (or warm-started segment) from its end
    # (common.make_tail_slices) and writes each slice's dS_out into h's own buffer, over the states
    # of the chunks the slices before it have done with, plus a pad of the first slice's size after
    # each sequence (segment, where the recomputed state pass runs the same segments): the
    # first slice is as large as the budget allows and each later one as large as the rows freed
    # before it, so the same peak takes fewer slices ((8, 2048): 11 + 21 chunks instead of
    # 11 + 11 + 10; H100, ops_gpu.py --variants --profile: forward + backward kernels 936 → 907
    # µs, peak 0.460 → 0.461 GiB, gradients the same to the bit).
    "state_bwd": dict(num_warps=4, waves=True, SV=8192, BV_min=16,
                      stages=(3, (3, {"QS": True}), 2, (2, {"QS": True}), (1, {"QS": True})),
                      TMA=False, from_inverse=True, slice_MB=44, max_slices=4, share_h=True),
    # TMA: the value loop's five tiles by tensor descriptors (chunk_bwd.dqk_kernel). Off: with
    # them, triton 3.6 on the H200 gives a non-finite dg (its row sums Σ S ⊙ dS of the copied h and
    # dh tiles) in 16 of 4440 runs of the T = 1 case under load, 0 of 4698 without; they would
    # save 699 → 651 µs at (4, 8192) (docs/TRITON.md).
    # fp32 inputs (ptxas, sm_90, (8, 2048); not timed): dqk at tiles of 32, one stage, spills
    # 320 + 328 B (3300 + 3472 B at the half inputs' settings; none at K tiles of 16, whose dQ and
    # dK products are the 16-wide dots triton 3.6 miscompiles in some kernels); wy_bwd, which holds
    # T and dT as [64, 64] fp32 tiles whatever its tiles, 268 + 316 B at 8 warps and tiles of 32
    # (3844 + 4472 B; 84 + 120 at tiles of 16).
    "dqk": dict(num_warps=4, stages=(3, 2, 1), BK=64, BV=64, TMA=False, fp32=dict(BK=32, BV=32, stages=(1,))),
    "wy_bwd": dict(num_warps=4, stages=(3, 2, 1), BK=64, BV=64, fp32=dict(num_warps=8, BK=32, BV=32, stages=(1,))),
    # The per-chunk backward of the gated delta members in one Gluon kernel (delta.triton.fused_bwd:
    # dqk and wy_bwd's work, accumulators placed over two warpgroups), each program on `items`
    # consecutive (chunk, value head) items (unrolled; the next item's first tiles and T⁻¹ land
    # during this one's epilogue, its q and k during its own value loop; outputs the same to the
    # bit at any count; compile seconds on the 2-core CPU at K = V = 128: 1.3, 2.4, 3.8, 5.7 for 1-4
    # items, spills 0, 16, 8, 16 bytes; H200 µs at (8, 2048) 412, 484, 993 for 1-3 items, and as a
    # run-time loop over the items 529, 492, 641 for 2, 4, 8: 1), taken on compute
    # capability 9 for 16-bit inputs, K ≤ 128: value tiles of BV (32 where BV does not divide V)
    # through a ring of NS slots filled by tensor copies, products asynchronous. H200 µs against dqk + wy_bwd: 961 against 1226 at (4, 8192), 487 against 624 at
    # (8, 2048), 3796 against 5721 at (1, 32768, HV = 64); value tiles of 32: 1021 at (4, 8192); a
    # third slot: 1050; persistent programs looping over the chunks spill and took 1523, and with
    # the item's body a call (few spills) 1191 against 1055; a program per chunk and key head
    # walking its value heads (no group_sum) spills too and took 5418 against 4046 + 314 at the
    # Qwen3.5-397B layout (docs/TRITON.md).
    # δ and dδ formed again here instead of stored by the passes before it: 7-8 % slower on an H100
    # (the added products lengthen every item by more than the saved traffic; docs/TRITON.md).
    "fused_bwd": dict(num_warps=8, stages=(1,), BV=64, NS=2, items=1, on=True),
    # The forward's sequential pass as one warp-specialised Gluon kernel (delta.triton.fused_fwd),
    # on for gated delta members in 16 bits on compute capability 9 with K of 64 or 128 and V of 64,
    # 128 or 256 (else state_out): one program per (sequence or warm-started segment, value head,
    # value tile of at most 128 columns) holding that tile of the state, a state, a δ and an output
    # warpgroup (which forms the pair matrix itself) and a copy warp, the chunks' tiles through a
    # ring of NS slots. regs: the copy, δ and output partitions'
    # registers a thread (the state's takes the rest of maxnreg times the program's 16 warps: 192;
    # with 16 fewer for the output, or for the state, the kernel spills).
    # H200 forward GPU µs, this pass + kkt_solve (+ warm_plan) against state_out + kkt_solve (bf16,
    # K = V = 128): (8, 2048) 117 + 72 against 185 + 107; (4, 8192) 232 + 141 + 23 against
    # 349 + 201; 1 × 32768 230 + 141 + 21 against 365 + 205; HV = 32 at 1 × 8192 122 + 72 + 19
    # against 193 + 103; Qwen3.5-397B 826 + 528 + 23 against 1356 + 776 (docs/TRITON.md).
    # VT: the value tile (at most 128). Tiles of 64 were slower at every shape timed, as the
    # forward and as the state pass (their sequences split into segments that fill the card
    # already): (4, 8192) 229 → 248 µs, Qwen3.5-397B 826 → 998, (8, 2048) 117 → 135.
    "fused_fwd": dict(num_warps=4, stages=(1,), NS=2, regs=(24, 128, 168), maxnreg=128, on=True, VT=128),
    # The same kernel as the backward's recomputed state pass (no output warpgroup; S copied out to
    # h and δ stored as the chain forms them): regs of the copy and δ partitions (the state's gets
    # 3 · 136 − 24 − 160 = 224; at 152 for δ it spills).
    "fused_states": dict(num_warps=4, stages=(1,), NS=2, regs=(24, 160), maxnreg=136, on=True, VT=128),
    # The backward's reverse pass as one warp-specialised Gluon kernel (delta.triton.fused_rev: the
    # work of dv_local and state_bwd), on for gated delta members in 16 bits on compute capability 9
    # with K of 64 or 128 and V of 64, 128 or 256 (value tiles of at most 128, as fused_fwd), but
    # for the chained split: a state, a δ and a local warpgroup and a copy warp, as fused_fwd. regs:
    # the copy, δ and local partitions' registers a thread.
    # VT: the value tile (at most 128); narrow: the tile of an unsplit pass whose programs on it
    # still fit one wave (fused_rev.plain_tile: the latency-bound chain finishes sooner on twice
    # the programs where half the card would idle; 0 never).
    # The merged backward (delta.triton.fused_rbwd: the reverse pass and the per-chunk gradients in
    # one kernel, K = V = 128). Off: slower than fused_rev + fused_bwd (docs/BENCHMARKS.md, "The
    # merged backward"). regs: copies, A, B (the chain takes 488 − A − B a thread: the pool is 64 K
    # registers over 16 warps' worth, each partition counted as a warpgroup; the chain spills below
    # 160); A forms dQ and dK (100 HGMMA steps a chunk), B the rest (44) and Σ S ⊙ dS, so A gets
    # the most: ptxas sm_90 64 + 73 spill stores and loads in A, 12 + 14 in B, 227 KB of shared
    # memory (tools/gluon_budget.py --rbwd). qk_b: B forms dγ's pair terms (Q Kᵀ ⊙ A's 16-bit
    # dO δᵀ ⊙ D) instead of A; dk_b: B forms dK's terms through M and dW and hands them to A in fp32
    # (docs/TRITON.md, "The second slot"; neither yet timed).
    "fused_rbwd": dict(num_warps=4, stages=(1,), on=False, regs=(24, 184, 144), maxnreg=128, qk_b=False,
                       dk_b=False),
    "fused_rev": dict(num_warps=4, stages=(1,), NS=2, regs=(24, 152, 168), maxnreg=128, on=True, VT=128,
                      narrow=64),
    "cumsum": dict(num_warps=1, stages=(1,)),
    # warm_plan reads one bound per chunk, 16 at a time: one warp; bound (a backward not handed the
    # forward's bounds) reads a chunk's [64, K] keys
    "warm_plan": dict(num_warps=1, stages=(1,)),
    "bound": dict(num_warps=4, stages=(1,)),
    # The split state passes (delta.triton.split.split_len): L = 0 off, > 0 a fixed segment length in
    # chunks, -1 automatic (warm-started passes only). warm: the gated members' split passes start
    # each segment from a zero state a bounded number of chunks early (state_fwd_kernel,
    # state_out_kernel and state_bwd_kernel, WARM) instead of chaining the segments' K × (K + V)
    # maps (the chained split, for the members without a gate, is correct on the H200 but slower,
    # so only an explicit L takes it); log_eps is the log of the bound on the state entering a
    # segment, relative to the true state where its warm-up starts. fill: split while the longest
    # sequences' programs number fewer than that many times the multiprocessors; per_sm: the
    # programs per multiprocessor the segments make (one wave). fused: the forward runs the fused
    # state-and-output pass on the segments (else the two-stage forward's state pass). GPU µs of
    # fwd | fwd+bwd kernels on the H200, off → on: 1 × 32768 1067 | 3898 → 592 | 2928; HV = 32 at
    # 1 × 8192 431 | 1882 → 300 | 1621; packed 12 sequences 750 | 3326 → 652 | 3113 (two-stage
    # forward on the segments: 673 | 2999 and 332 | 1660, docs/TRITON.md).
    "split": dict(L=-1, min_L=8, warm=True, log_eps=-16.0, fill=2.0, per_sm=2, fused=True),
    # The split passes' first phase (K + V columns per state; SV = K · columns of one tile).
    "state_aug": dict(num_warps=4, stages=(2, 1), SV=8192),
    "chain": dict(num_warps=4, stages=(1,), SV=4096, BC=32),
}

#: The per-channel-gate (KDA) chunk kernels. Chosen from ptxas's register report for sm_90 at
#: K = V = 128 (``python tools/sass_cpu.py --op kda --shape 8x2048 [--dtype fp16|fp32]``): the tiles
#: and warps without spills, then with the most programs per multiprocessor; then kkt, dqk, wy_bwd,
#: intra_bwd, wu and output by timing on the H200 (below). Register caps (a ``{"maxnreg": N}``
#: form) were taken where the H200 timed them faster, for the programs per multiprocessor they
#: give: intra_bwd, wy_bwd and state_fwd's capped candidate. The kernels hold little enough live
#: state that ptxas spills nothing at these settings in bf16, state_fwd's capped candidate in its
#: descriptor-read form (TMA, below) included (fp16: its 4 + 4 bytes of stores + loads and
#: intra_bwd's 12 + 12; fp32: the state passes, wy_bwd and intra_bwd), docs/KDA.md "Spill-free at
#: the timed settings".
#: wu takes 8 warps for the reason the scalar-gate wu does. An entry's ``fp32`` dict overrides it
#: for fp32 inputs (their 3-pass tf32 dots hold two tiles per operand).
KDA = {
    "gamma": dict(num_warps=4, stages=(1,), BK=64),
    # Whole-chunk products (kkt_kernel: per K tile one [64, BK] × [BK, 64] product per row block, A
    # to an fp32 scratch; the block solve was its tail then, solve_kernel now). bf16, 8 warps: 248
    # registers at BK = 64, 184 at 32, no spills; fp32 at 32 with its row blocks in a run-time loop
    # (ROW_LOOP) no spills either. (8, 2048, 16, 128) bf16 on the H200:
    # 602 µs, against 663 for the earlier row-block-by-row-block kernel at its best setting (2 warps,
    # BK = 32, which spilled 128 bytes; BK = 16, BKD = 4 without spills: 788) (benchmarks/kda_gpu.py
    # --profile --config, 2026-12-01). At 4 warps: 588 -> 361 µs at that shape (2026-12-02; two
    # stages at 8 warps: 683; fp32 inputs keep 8). BKD, the K tile of the slow path's [16, 16, BKD]
    # pairwise exponents: 4, no spills (ptxas at 4 warps, bf16: 255 registers; 16 + 20 B of spills
    # at 8); H200, (8, 2048, 16, 128) bf16, kkt 268–270 µs against 266 at 8 (BK = 32, no spills
    # either: 276) (tools/sass_cpu.py --op kda --kernels kkt; kda_gpu.py --profile, 2026-12-04).
    # ROW_LOOP: the row blocks in a run-time loop (fp32 inputs: unrolled, the 3-pass operands of
    # the four blocks spill 44 + 44 bytes).
    "kkt": dict(num_warps=4, stages=(1,), BK=64, BKD=4, ROW_LOOP=False, fp32=dict(BK=32, num_warps=8, ROW_LOOP=True)),
    # The block solve of kkt's A (solve_kernel), split off kkt so the two compile in parallel: H200
    # cold first forward at (8, 2048, 16, 128) 5.5–5.7 → 2.3–3.3 s; GPU time kkt 357 → 266 + 102 µs
    # (the scratch read from memory, not L2); 2 warps: 238 registers, no spills.
    "solve": dict(num_warps=2, stages=(1,)),
    # wu at three stages: 526 -> 437 µs over its two runs in a forward+backward at (8, 2048, 16, 128)
    # bf16 on the H200 (K and V tiles of 64 at two stages: 453).
    "wu": dict(num_warps=8, stages=(3,), BK=32, BV=32),
    # BV_min 32: at tiles of 16 triton 3.6 compiles this state_fwd kernel (fp32, 8 warps) with an
    # out-of-range shared-memory read on the H200 (compute-sanitizer).
    # The state passes: 8 warps, one stage. At 4 warps (two programs per multiprocessor, no spills
    # in bf16 by ptxas's count) triton 3.6 miscompiles them on the H200: bf16 state_bwd gave dh0
    # off by 6e-2 and dk, dv, dg, dβ by 2e-2 at every tests/gpu shape, and the T = 63, V = 16 case
    # read out of bounds.
    # per_sm: the programs per multiprocessor a pass's value tile is sized for
    # (chunk_fwd.state_vtile). state_fwd: the register cap (one stage at 128 registers: two programs
    # per multiprocessor; spills below, TMA) when it saves a wave: 311 -> 213 µs at (8, 2048, 16, 128)
    # bf16. state_bwd: value tiles of 128 instead (one program per multiprocessor, 128 programs in
    # one wave at (8, 2048)): 348 -> 278 µs, where the cap gave 327 (benchmarks/kda_gpu.py --profile
    # --config, H200).
    # fp32 inputs: one candidate and value tiles of 64 in both passes (their states spill at every
    # setting by ptxas, 0.2-1.1 KB, and neither the cap nor tiles of 128 was timed for them).
    # TMA: W, KT and U read through tensor descriptors where the card has them (the states stored
    # through pointers): no spills at the cap in bf16 (ptxas sm_90, (8, 2048) and (4, 8192)), where
    # the pointer form spills 68 + 68 bytes (40 + 40 in the backward's recompute). On: the KDA
    # chunk kernels hold no spills in bf16 at K = V = 128 with it, at a measured price (H200,
    # benchmarks/kda_gpu.py --profile --config, 2026-12-05, pointer → descriptor form): the
    # forward's pass 207 → 238 µs at (8, 2048, 16, 128) bf16 and 553 → 682 at (4, 8192), the
    # forward + backward's kernels 3901 → 3961 and 8129 → 8386 µs (+1.5 %, +3.2 %), still ahead of
    # FLA's chunk_kda (4851 and 9864 µs of wall, 2026-12-02). A form that also stored the states
    # through descriptors was slower again (258 and 746 µs).
    "state_fwd": dict(num_warps=8, stages=(1, (1, {"maxnreg": 128})), waves=True, SV=8192, BV_min=32, per_sm=2,
                      TMA=True, fp32=dict(stages=(1,), per_sm=1)),
    "output": dict(num_warps=8, stages=(1,), BK=64, BV=64),
    "dv_local": dict(num_warps=4, stages=(1,), BV=64),
    "state_bwd": dict(num_warps=8, stages=(1,), SV=16384, BV_min=32, per_sm=1, fp32=dict(SV=8192)),
    # fp32: K tiles of 32 (at 8 warps: no spills; 64: 284 bytes of spill stores). bf16 keeps 64
    # (32 reads dO, δ, dδ twice as often).
    # dqk and wy_bwd at 4 warps: 1265 → 822 and 869 → 575 µs at (8, 2048, 16, 128) bf16 on the H200
    # (benchmarks/kda_gpu.py --profile --config; GPU tests passed at these settings). wu and output
    # were level at 4 warps (522 → 525, 135 → 141) and keep 8.
    # dqk at two stages: 732 -> 636 µs at (8, 2048) bf16, at three 590 (no spills); fp32
    # inputs keep one stage (their tiles take twice the shared memory).
    "dqk": dict(num_warps=4, stages=(3,), BK=64, BV=32, fp32=dict(BK=32, stages=(1,))),
    # wy_bwd capped at 168 registers (three programs per multiprocessor): 554 -> 526 µs; dqk at 168
    # slowed (731 -> 762) and kkt at 128 too (583 -> 684).
    # Two stages at the cap: 525 -> 466 µs (fp32 inputs keep one).
    "wy_bwd": dict(num_warps=4, stages=((2, {"maxnreg": 168}),), BK=32, BV=32,
                   fp32=dict(stages=((1, {"maxnreg": 168}),))),
    # 4 warps: 3014 µs at (8, 2048, 16, 128) bf16 against 5649 at 8 (two programs per multiprocessor
    # instead of one). Capped at 168 registers (three programs per multiprocessor): 2850 -> 2236
    # µs; at 128 (four): 2084 µs. PREC, the precision of its fp32 dots: one-pass tf32 for bf16
    # inputs (their own rounding is coarser), whose operands take a third of 3-pass's registers
    # (ptxas sm_90 bf16 at 128 registers: no spills); 1555 against 2043 µs at (8, 2048) on the
    # H200. 3-pass for fp32 and fp16 inputs (the pair loop's two sides then in separate loops): fp16
    # rounds as finely as one-pass tf32, and with it dq, dk and dg exceed the GPU tests' fp16 bounds
    # by up to 25 % (tests/gpu/test_kda.py).
    # fp16 keeps the cap too: uncapped it holds 142 registers without spills (12 + 12 B at 128) but
    # three programs a multiprocessor instead of four, and the forward + backward took 7 % longer
    # (H100, 2026-12-05: 4.64 → 4.96 ms at (8, 2048, 16, 128), 9.68 → 10.33 at (4, 8192)).
    "intra_bwd": dict(num_warps=4, stages=((1, {"maxnreg": 128}),), BK=32, PREC="tf32", fp32=dict(PREC="tf32x3"),
                      fp16=dict(PREC="tf32x3")),
}

#: The token-recurrent and glue kernels (no candidates: one setting each, or a rule below).
OTHER = {
    # Scalar-gate recurrent kernel (recurrent_tiles): value tiles of at most BV_max, halved while
    # fewer than ``programs`` (about one per multiprocessor of an H100/H200) would run; warps keep
    # ~``per_warp`` state elements per thread-group. At B = 256, HV = 32, K = V = 128 on the H200,
    # BV = 64 with 4 warps reached 93 % of the copy bandwidth (8 warps 74 %).
    "recurrent": dict(BV_max=64, BV_min=8, programs=128, per_warp=2048, max_warps=8),
    # KDA recurrent kernel: a checkpoint of the state every CK tokens (the backward recomputes a
    # stretch of CK states); value tiles of 64, 32 when K > 128 (registers).
    "kda_recurrent": dict(CK=16, BV=64, BV_wide_K=32),
    # L2 norm and gate prologue of the fused Gated DeltaNet entry point.
    "l2norm": dict(num_warps=4, BR=16),
    "gate": dict(num_warps=4, BLOCK=1024),
    # RMSNorm (norm_tiles): rows per block so a block holds ``elements`` values (1024 under the
    # interpreter); 8 warps from rows of 2048. The backward aims at ``programs`` programs. On an H100
    # at [16384, 1024] and [98304, 256] these were the backward's best of elements ∈ {4096, 8192} ×
    # programs ∈ {1024, 2048}; 8192 spills there (its next block held beside this one's): 4–9× slower.
    "rmsnorm": dict(elements=4096, max_rows=64, wide=2048, programs=1024),
    # Short convolution. Forward: tiles of BT tokens × BD channels (64 under the interpreter).
    # Backward: BD_bwd channels walked over L tokens, U an iteration; L as large as
    # leaves ``programs`` programs a multiprocessor. On an H100 at [4, 4096, 768] and [.., 1536]
    # 2 warps (4 channels a thread) took 0.90× one warp's time, the best of L_min ∈ {16, 32} × U ∈
    # {4, 8} × 1–2 warps (53 and 86 µs against byte floors of 23 and 45).
    "short_conv": dict(num_warps=4, BT=32, BD=128, BD_bwd=256, warps_bwd=2, U=4, L_min=16, L_max=64, programs=8),
    # Decode products of at most max_rows rows (gdn.ops.gemv): BN output columns per program, the
    # largest power of two up to BN_max that leaves ``programs`` × the multiprocessors programs; K
    # tiles of ``elements`` / BN.
    "gemv": dict(max_rows=4, num_warps=4, BN_max=16, programs=2, elements=4096),
    # One decode step of the short convolution: BD channels of one row per program (the whole
    # row, up to 1024, under the interpreter).
    "conv_step": dict(num_warps=4, BD=512),
    # SwiGLU: tiles of BLOCK elements, rows × up to BI columns (8 warps: 8 elements, one 16-byte
    # vector of bf16, a thread).
    "swiglu": dict(num_warps=8, BLOCK=2048, BI=256),
    "cross_entropy": dict(num_warps=8, BLOCK=4096),
    "pool_commit": dict(num_warps=4, BLOCK=4096),
}

#: The tables by name, for :func:`update` (``{"delta": …, "kda": …, "other": …}``).
TABLES = {"delta": DELTA, "kda": KDA, "other": OTHER}


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for host code (``triton.cdiv`` is a constexpr function there: ≈ 1.6 µs a call, and
    a chunk op's forward + backward computes a dozen grids and tiles)."""
    return -(-a // b)


def pow2(n: int, lo: int = 16) -> int:
    """Smallest power of two ≥ max(n, lo) (tl.dot needs tiles of at least 16)."""
    return max(lo, 1 << (int(n) - 1).bit_length()) if n > 1 else lo


#: The override key of an entry for inputs of a dtype (by the dtype's name: this module does not
#: import torch): fp32 inputs' 3-pass tf32 dots hold each fp32 operand as two tiles, so they need
#: other tiles and warps than half inputs to stay clear of spills; fp16 inputs' 10-bit mantissa is
#: as fine as one-pass tf32's (KDA's intra_bwd takes 3-pass for them).
_DTYPE_KEYS = {"torch.float32": "fp32", "torch.float16": "fp16"}


def for_dtype(entry: dict, io=None) -> dict:
    """A kernel's table ``entry`` for inputs of dtype ``io``: with the entry's ``fp32`` or ``fp16``
    overrides applied where it has them for that dtype (the entry itself otherwise)."""
    key = _DTYPE_KEYS.get(str(io)) if io is not None else None
    return {**entry, **entry[key]} if key in entry else entry


def chunk_tiles(name: str, K: int, V: int, table: dict = DELTA, io=None) -> tuple[int, int]:
    """(BK, BV) of chunk kernel ``name`` (for inputs of dtype ``io``: :func:`for_dtype`): its tiles
    capped at the next power of two of K and V; for a sequential pass (an ``SV`` entry) the whole K
    and ``SV // BK`` values."""
    c = for_dtype(table[name], io)
    if "SV" in c:
        BK = pow2(K)
        return BK, min(pow2(V), max(16, c["SV"] // BK))
    return min(c.get("BK", 1 << 30), pow2(K)), min(c.get("BV", 1 << 30), pow2(V))


def recurrent_tiles(n_heads: int, K: int, V: int) -> tuple[int, int, int]:
    """(BK, BV, num_warps) of the scalar-gate recurrent kernel for ``n_heads`` (sequence, value
    head) pairs: BK covers K; BV the widest tile (≤ BV_max) that still gives ``programs`` programs,
    so one sequence spreads over the card and a large batch moves the state in wide tiles."""
    c = OTHER["recurrent"]
    BK, BV = pow2(K, 1), min(pow2(V, 1), c["BV_max"])
    while BV > c["BV_min"] and n_heads * -(-V // BV) < c["programs"]:
        BV //= 2
    return BK, BV, max(1, min(c["max_warps"], BK * BV // c["per_warp"]))


def kda_recurrent_tiles(K: int, V: int) -> tuple[int, int]:
    """(BK, BV) of the KDA recurrent kernels."""
    c = OTHER["kda_recurrent"]
    BK = pow2(K)
    return BK, min(pow2(V), c["BV_wide_K"] if BK > 128 else c["BV"])


def norm_tiles(D: int) -> tuple[int, int, int]:
    """(rows a block, padded width, warps) of the RMSNorm kernels for rows of D elements."""
    c = OTHER["rmsnorm"]
    BD = pow2(D, 1)
    BR = max(1, min(c["max_rows"], (1024 if INTERPRET else c["elements"]) // BD))
    return BR, BD, 8 if BD >= c["wide"] else 4


#: settings the launch code reads with a default, so an entry may lack them
OPTIONAL = ("waves", "per_sm")


def update(partial: dict) -> None:
    """Apply ``{kernel: {key: value}}`` (e.g. parsed JSON) in place: plain names are chunk kernels
    of :data:`DELTA`, ``"kda.NAME"`` of :data:`KDA`, ``"other.NAME"`` of :data:`OTHER`. ``stages``
    lists become tuples (a [depth, form] entry a pair). For benchmarks that try settings. A kernel
    or setting the tables do not have raises ValueError naming it (a misspelt setting would
    otherwise be timed as the defaults), before anything is changed."""
    plan = []
    for key, upd in partial.items():
        prefix, name = key.split(".", 1) if "." in key else ("", key)
        table = TABLES.get(prefix) if prefix else DELTA
        if table is None or name not in table:
            raise ValueError(f"launch settings: no kernel {key!r} (kernels: {', '.join(sorted(DELTA))}, "
                             f"and kda.NAME / other.NAME of the KDA and OTHER tables)")
        unknown = sorted(k for k in upd if k not in table[name] and k not in OPTIONAL)
        if unknown:
            raise ValueError(f"launch settings: {key!r} has no setting {', '.join(map(repr, unknown))} "
                             f"(it has {', '.join(sorted(table[name]))})")
        plan.append((table[name], upd))
    for entry, upd in plan:
        entry.update({k: tuple(x if isinstance(x, int) else (x[0], x[1]) for x in v) if k == "stages" else v
                      for k, v in upd.items()})
    _EDITS[0] += 1


def restore(saved: dict) -> None:
    """Put the tables back to ``saved`` (a deep copy of :data:`TABLES`), each table object kept (the
    kernel modules hold it) and its entries replaced by new objects, which :func:`token` sees."""
    for name, table in TABLES.items():
        table.clear()
        table.update(copy.deepcopy(saved[name]))


_EDITS = [0]  # update() calls so far
_HELD: dict = {}  # id -> every entry a token was made of (alive, so that no later entry reuses its id)
_LAST: list = [None]


def token() -> tuple:
    """A value that changes whenever the tables change, for results worked out from them and kept
    (the chunk op's per-shape decisions): :func:`update`'s count of edits and the identity of every
    entry (an entry replaced whole, as tests do with ``monkeypatch.setitem``, is a new object).
    Entries are edited in place only through :func:`update`, which it counts."""
    ids = (_EDITS[0],) + tuple(map(id, DELTA.values())) + tuple(map(id, KDA.values()))
    if ids != _LAST[0]:
        _LAST[0] = ids
        for entry in (*DELTA.values(), *KDA.values()):
            _HELD.setdefault(id(entry), entry)
    return ids


def read_json(arg: str):
    """The JSON value of a file's path or of an inline JSON text (the benchmarks' --config and
    --variants); ValueError where it is neither."""
    if os.path.exists(arg):
        with open(arg) as f:
            arg = f.read()
    return json.loads(arg)


def update_from(arg: str) -> None:
    """:func:`update` from a JSON file's path or an inline JSON text (the benchmarks' --config)."""
    update(read_json(arg))


def apply_config(parser, arg: str | None) -> None:
    """A command line's ``--config``: :func:`update_from` of ``arg`` when given; bad JSON or a setting
    the tables do not have is ``parser``'s usage error naming --config (exit status 2)."""
    if arg:
        try:
            update_from(arg)
        except ValueError as e:  # (json's errors are ValueErrors too)
            parser.error(f"--config: {e}")
