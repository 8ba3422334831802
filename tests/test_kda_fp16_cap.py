"""tools/kda_fp16_cap.py: the fp16 intra_bwd register-cap comparison is GPU-only; without CUDA it
says so in one line and exits with status 2. Its first two forms are the tuning table's fp16 entry
with and without the cap, each accepted by gdn.ops.tuning.update."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from tests.run_tool import run_tool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_without_cuda_one_line_and_status_2():
    r = run_tool("kda_fp16_cap.py", timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "kda_fp16_cap: needs CUDA"


def test_forms_are_the_fp16_entry_with_and_without_the_cap():
    from gdn.ops import tuning
    from tools.kda_fp16_cap import FORMS

    saved = copy.deepcopy(tuning.KDA["intra_bwd"])
    try:
        seen = []
        for _, cfg in FORMS:
            tuning.update(cfg)
            seen.append(tuning.KDA["intra_bwd"]["fp16"])
        assert seen[0]["PREC"] == seen[1]["PREC"] == saved["fp16"]["PREC"]
        assert seen[0]["stages"] == [[1, {"maxnreg": 128}]] and seen[1]["stages"] == [1]
        assert tuple(saved["stages"]) == ((1, {"maxnreg": 128}),)  # the default: capped, fp16 included
        assert "stages" not in saved["fp16"]
    finally:
        tuning.KDA["intra_bwd"] = saved
