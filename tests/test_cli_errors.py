"""Bad input through the real ``gdn`` console script, in a subprocess: one line on stderr naming
what is wrong, exit status 2, no traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

GDN = Path(sys.executable).with_name("gdn")


def run_gdn(*args, cwd):
    if not GDN.exists():
        pytest.skip("the gdn console script is not installed next to this interpreter")
    return subprocess.run([str(GDN), *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
                               "HF_HUB_OFFLINE": "1"})


def assert_one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    err = res.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.parametrize("case", ["odd_bin", "big_ids", "binary_text", "missing_hf"])
def test_train_rejects_bad_data(tmp_path, case):
    if case == "odd_bin":
        (tmp_path / "x.bin").write_bytes(b"\1\2\3")
        data, needles = "x.bin", ("x.bin", "3 bytes")
    elif case == "big_ids":
        (tmp_path / "x.bin").write_bytes(np.array([1, 999, 3], dtype=np.uint16).tobytes())
        data, needles = "x.bin", ("id 999", "vocabulary of 256")
    elif case == "binary_text":
        (tmp_path / "x.dat").write_bytes(b"\0\1" * 500)
        data, needles = "x.dat", ("x.dat", "binary")
    else:
        data, needles = "hf:/missing", ("hf:/missing", "no such file or folder")
    res = run_gdn("train", "--data", data, "--out", "run", "--steps", "2", cwd=tmp_path)
    assert_one_line_error(res, *needles)


def test_tokenizer_train_rejects_missing_data(tmp_path):
    res = run_gdn("tokenizer", "train", "--data", str(tmp_path / "missing"), "--out", "tok.json", cwd=tmp_path)
    assert_one_line_error(res, "missing", "no such file or folder")
