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
    """Exit status 2, no traceback, and one error line (progress log lines may precede it)."""
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.strip().splitlines() if not ln.startswith(("INFO ", "WARNING ", "DEBUG "))]
    assert len(lines) == 1, res.stderr[-2000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])


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


def test_bad_numbers_and_devices_are_usage_errors(tmp_path):
    res = run_gdn("eval", "--ckpt", "nowhere", "--batches", "0", cwd=tmp_path)
    assert_one_line_error(res, "--batches", "positive int", "'0'")
    res = run_gdn("generate", "--ckpt", "nowhere", "--temperature", "-1", cwd=tmp_path)
    assert_one_line_error(res, "--temperature", "non-negative")
    for bad in ("2", "0", "nan", "x"):
        res = run_gdn("generate", "--ckpt", "nowhere", "--top-p", bad, cwd=tmp_path)
        assert_one_line_error(res, "--top-p", "(0, 1]", repr(bad))
    import torch

    if not torch.cuda.is_available():
        res = run_gdn("generate", "--ckpt", "nowhere", "--device", "cuda", cwd=tmp_path)
        assert_one_line_error(res, "--device", "no CUDA device", "--device cpu")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A two-step run of a tiny model (in this process: the CLI's own train command)."""
    from gdn.cli import main

    root = tmp_path_factory.mktemp("tiny")
    (root / "data").mkdir()
    for i in range(6):
        (root / "data" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * (20 + i))
    args = ["train", "--data", str(root / "data"), "--out", str(root / "run"), "--steps", "2"]
    for s in TINY:
        args += ["--set", s]
    assert main(args) == 0
    return root / "run"


#: a model and run small enough for a few CPU steps in a test
TINY = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.head_dim=16", "model.intermediate_size=64",
        "seq_len=32", "batch_size=2", "eval_every=2", "eval_batches=1", "save_every=2", "tensorboard=false",
        "progress=false", "val_fraction=0.25", "warmup_steps=1"]


def test_a_diverging_run_stops_with_a_checkpoint_and_says_what_to_do(tmp_path, tiny_run):
    """lr = 1e30: the first update blows the weights up and every later loss is NaN; with
    max_bad_steps = 3 the run stops after step 4 (three updates skipped) with a checkpoint, exit
    status 1, one error line saying how to go on, and the summary counts the skipped updates."""
    args = ["train", "--data", str(tiny_run.parent / "data"), "--out", str(tmp_path / "run"), "--steps", "12"]
    for s in TINY + ["lr=1e30", "max_bad_steps=3", "save_every=100"]:
        args += ["--set", s]
    res = run_gdn(*args, cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    errors = [ln for ln in res.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "diverged" in errors[0] and "--resume --set lr=" in errors[0], res.stderr[-2000:]
    assert "step_00000004" in errors[0] and (tmp_path / "run" / "checkpoints" / "step_00000004").is_dir()
    assert res.stderr.count("update skipped") == 3 and "3 of 4 updates skipped" in res.stdout, res.stdout


def test_resume_below_or_at_the_runs_step(tmp_path, tiny_run):
    """Resuming with fewer steps than the checkpoint's is a usage error; with as many, nothing is
    trained and the summary says so (no NaN loss)."""
    res = run_gdn("train", "--resume", str(tiny_run), "--steps", "1", cwd=tmp_path)
    assert_one_line_error(res, "steps = 1", "checkpoint's step 2", "--steps above 2")
    res = run_gdn("train", "--resume", str(tiny_run), "--steps", "2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "nothing to train" in res.stderr and "no step trained" in res.stdout and "nan" not in res.stdout, res.stdout


@pytest.mark.slow  # lm-eval's import and its download attempt: `make test-all`
def test_eval_task_without_network_says_how_to_use_a_local_task(tmp_path, tiny_run):
    pytest.importorskip("lm_eval")
    res = run_gdn("eval", "--ckpt", str(tiny_run), "--tasks", "lambada_openai", "--limit", "2", "--device", "cpu",
                  cwd=tmp_path)
    assert_one_line_error(res, "lambada_openai", "could not be downloaded", "--include-path")
    res = run_gdn("eval", "--ckpt", str(tiny_run), "--tasks", "no_such_task_xyz", "--device", "cpu", cwd=tmp_path)
    assert_one_line_error(res, "no_such_task_xyz", "unknown lm-eval task")


def test_train_list_keys_documents_every_key(tmp_path):
    """``gdn train --list-keys`` prints every TrainConfig key with its type, default and help line."""
    import dataclasses

    from gdn.train import TrainConfig

    res = run_gdn("train", "--list-keys", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = {ln.split()[0]: ln for ln in res.stdout.splitlines() if ln.strip() and not ln.startswith("model.KEY")}
    for f in dataclasses.fields(TrainConfig):
        line = lines[f.name]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert f"default {default!r}" in line and len(line.split("  ")[-1].strip()) > 3, line
    assert "hidden_size" in res.stdout.splitlines()[-1]
    assert not any(tmp_path.iterdir())  # listing runs nothing


def test_help_and_version_answer_fast(tmp_path):
    """``gdn --help`` and ``gdn --version`` import neither torch nor transformers."""
    res = run_gdn("--version", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip()
    probe = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['gdn', '--help']; import gdn.cli as c; "
                            "c.build_parser(); print('torch' in sys.modules, 'transformers' in sys.modules)"],
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.split() == ["False", "False"], probe.stdout + probe.stderr


def test_help_shows_defaults(tmp_path):
    res = run_gdn("generate", "--help", cwd=tmp_path)
    assert res.returncode == 0
    text = " ".join(res.stdout.split())
    assert "tokens to generate (default: 200)" in text and "0 = greedy (default: 0.8)" in text


def test_generate_from_a_folder_without_checkpoints(tmp_path):
    """A --ckpt that is neither a checkpoint nor a run folder with checkpoints: one line naming both
    places looked at (exit status 3, a checkpoint error), no traceback."""
    res = run_gdn("generate", "--ckpt", str(tmp_path), "--prompt", "hi", cwd=tmp_path)
    assert res.returncode == 3 and "Traceback" not in res.stderr, res.stderr[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    assert f"{tmp_path} is not a checkpoint folder" in line and str(tmp_path / "checkpoints") in line, line
