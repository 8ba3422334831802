"""tools/ncu_stalls.py: reads Nsight Compute's per-instruction source CSV (two kernels, the second
profiled twice), picks the launch asked for, and shares out its stall samples by reason, by
instruction and by stretch between synchronising instructions; a kernel not in the file is one
clear line and exit status 2."""
from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import ncu_stalls  # noqa: E402

COLS = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
        "L2 Theoretical Sectors Global Excessive", "stall_long_sb", "stall_barrier", "stall_long_sb (Not Issued)"]


def _write(path: Path) -> None:
    """other_kernel once, then k twice: its first launch with 100 samples, its second with one per
    instruction."""
    k = [["0x00", "LDG.E R2, desc[UR4][R2.64]", "10", "8", "6", "10", "0", "1"],
         ["0x10", "STS [R1], R2", "30", "8", "0", "30", "0", "2"],
         ["0x20", "BAR.SYNC.DEFER_BLOCKING 0x0", "20", "8", "0", "0", "20", "3"],
         ["0x30", "@!P0 STG.E desc[UR4][R4.64], R5", "40", "8", "2", "40", "0", "4"]]
    k_again = [[a, s, "1", e, x, "1", "0", "0"] for a, s, _, e, x, *_ in k]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for name, rows in (("other_kernel", [["0x10", "NOP", "5", "1", "0", "5", "0", "0"]]), ("k", k),
                           ("k", k_again)):
            w.writerow(["Kernel Name", name])
            w.writerow(COLS)
            w.writerows(rows)


def test_launches_and_report(tmp_path, capsys):
    p = tmp_path / "sass.csv"
    _write(p)
    runs = ncu_stalls.launches(str(p), "k")
    assert len(runs) == 2 and len(runs[0]) == 4
    assert [ncu_stalls.opcode(r["Source"]) for r in runs[0]] == ["LDG", "STS", "BAR", "STG"]
    text = ncu_stalls.report(runs[0], top=2, min_share=0.0)
    # 100 samples: long_sb 80, barrier 20; 8 excess sectors; the STG (40) and STS (30) on top
    assert "100 samples" in text and "long_sb 80.0%" in text and "barrier 20.0%" in text
    assert "sectors beyond the ideal: 8" in text
    top = text.split("the 2 instructions")[1].splitlines()[1:3]
    assert "STG.E" in top[0] and "40.0%" in top[0] and "STS" in top[1]
    # two stretches: up to the barrier (60 %), then the rest (40 %)
    stretches = text.split("stretches")[1].splitlines()[1:]
    assert len(stretches) == 2 and "60.0%" in stretches[0] and "40.0%" in stretches[1]
    assert ncu_stalls.main([str(p), "--kernel", "k", "--launch", "2"]) == 0
    assert "4 samples" in capsys.readouterr().out


def test_missing_kernel_is_one_line(tmp_path, capsys):
    p = tmp_path / "sass.csv"
    _write(p)
    assert ncu_stalls.main([str(p), "--kernel", "absent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --launch: absent has 0")


def _ws_rows() -> list:
    """A two-partition launch: partition 1 (after the first USETMAXREG) waits in an out-of-line loop
    after the kernel's EXIT and branches back; partition 2 reloads a spill (LDL, 8 local sectors)
    and runs one HGMMA."""
    def row(a, src, smp, ex=1, local=0):
        # every sample outside the wait loops a long scoreboard wait but the LDL's (short)
        why = "stall_short_scoreboard" if src.startswith("LDL") else "stall_long_scoreboard"
        return {"Address": hex(0x1000 + 16 * a), "Source": src, ncu_stalls.SAMPLES: str(smp),
                "Instructions Executed": str(ex), ncu_stalls.LOCAL: str(local),
                "stall_long_scoreboard": str(smp if why == "stall_long_scoreboard" else 0),
                "stall_short_scoreboard": str(smp if why == "stall_short_scoreboard" else 0)}

    return [row(0, "MOV R1, c[0x0][0x28]", 1),
            row(1, "USETMAXREG.DEALLOC.CTAPOOL 0x18", 0),
            row(2, "@!P1 BRA " + hex(0x1000 + 16 * 8), 10),   # into the wait loop at 8
            row(3, "FADD R2, R2, R3", 5),
            row(4, "USETMAXREG.ALLOC.CTAPOOL 0xc0", 0),
            row(5, "LDL R4, [R1+0x10]", 6, ex=4, local=8),
            row(6, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ", 4),
            row(7, "EXIT", 0),
            row(8, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR6+0x38a08], R2", 30),
            row(9, "@!P1 BRA " + hex(0x1000 + 16 * 8), 40),
            row(10, "BRA " + hex(0x1000 + 16 * 3), 4)]          # back to partition 1


def test_partitions_take_their_wait_loops():
    parts = ncu_stalls.partitions(_ws_rows())
    assert [(p["first"], p["last"]) for p in parts] == [(0, 0), (1, 3), (4, 7)]
    p1, p2 = parts[1], parts[2]
    # partition 1: its own 15 samples and the loop's 74; waiting: the branch in (10) and the loop (74)
    assert p1["samples"] == 89 and p1["wait"] == 84 and p1["hgmma"] == 0
    assert p2["samples"] == 10 and p2["wait"] == 0 and p2["hgmma"] == 1 and p2["ldl"] == 4 and p2["local"] == 8
    assert abs(sum(p["share"] for p in parts) - 100) < 1e-9
    text = ncu_stalls.partition_report(_ws_rows())
    assert "| 1–3 | 89.0 | 84.0 | 0 |" in text and "| 4–7 | 10.0 | 0.0 | 1 | 4 | 8 |" in text
    # stall reasons outside the waits: partition 1's FADD (5), partition 2's LDL (6) and HGMMA (4)
    assert p1["reasons"] == {"long_scoreboard": 5, "short_scoreboard": 0}
    assert p2["reasons"] == {"short_scoreboard": 6, "long_scoreboard": 4}
    assert "| 4–7 | 10.0 | 0.0 | 1 | 4 | 8 | short_scoreboard 6.0, long_scoreboard 4.0 |" in text
