"""tools/train_probe.py on a tiny model: the packed row's documents agree with themselves run alone,
no gradient is non-finite, and every step prints its loss."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def test_probe_reports_the_packed_row_and_each_step(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    from tools import train_probe

    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        (data / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * (30 + 7 * i))
    sets = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.head_dim=16", "model.intermediate_size=64",
            f"data={data}", "val_fraction=0.25", "tensorboard=false", "warmup_steps=1"]
    train_probe.main(["--size", "tiny", "--seq-len", "64", "--batch", "2", "--steps", "2"]
                     + [x for s in sets for x in ("--set", s)])
    out = capsys.readouterr().out
    diffs = [float(ln.split("packed| ")[1].split(",")[0]) for ln in out.splitlines() if "max |alone - packed|" in ln]
    assert diffs and max(diffs) < 1e-4, out
    assert "non-finite gradients: 0 parameters" in out and "step 1: loss" in out and "step 2: loss" in out, out
