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
