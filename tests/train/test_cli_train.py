"""``gdn train`` through the real console script, in a subprocess: resuming keeps the run's settings
and says what changed, a different model or a mistyped key is one line on stderr (exit status 2),
and a second Ctrl-C while a checkpoint is written lets the checkpoint finish."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gdn.checkpoint import list_checkpoints, verify

from .helpers import write_corpus

GDN = Path(sys.executable).with_name("gdn")
ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
#: A 2-layer, width-32 model on 16-token windows: a run of a few steps takes seconds, mostly imports.
TINY = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.head_dim=16", "model.intermediate_size=64",
        "eval_batches=1", "tensorboard=false", "progress=false", "val_fraction=0.25", "warmup_steps=1"]


def sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def gdn(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    if not GDN.exists():
        pytest.skip("the gdn console script is not installed next to this interpreter")
    return subprocess.run([str(GDN), *args], capture_output=True, text=True, cwd=cwd, timeout=300, env=ENV)


def assert_one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    err = res.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)


@pytest.fixture(scope="module")
def run_t1(tmp_path_factory):
    """``runs/t1``: 4 steps at seq_len 16, batch_size 4, lr 0.002, a checkpoint every 2 steps."""
    root = tmp_path_factory.mktemp("cli_train")
    write_corpus(root / "data")
    res = gdn("train", "--data", "data", "--out", "runs/t1", "--steps", "4",
              *sets(*TINY, "seq_len=16", "batch_size=4", "lr=0.002", "eval_every=2", "save_every=2", "log_every=1"),
              cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    return root


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src / "data", dst / "data")
    shutil.copytree(src / "runs", dst / "runs")
    return dst


def test_resume_keeps_the_runs_settings_and_names_what_changed(run_t1, tmp_path):
    root = _copy_run(run_t1, tmp_path)
    before = yaml.safe_load((root / "runs/t1/config.yaml").read_text())
    res = gdn("train", "--out", "runs/t1", "--resume", "--steps", "6", "--set", "lr=0.001", cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    warnings = [line for line in res.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, res.stderr
    assert "resuming runs/t1 with changed settings: steps 4 -> 6, lr 0.002 -> 0.001" in warnings[0], warnings
    # the run's data, windows, batch, intervals: not the built-in defaults
    after = yaml.safe_load((root / "runs/t1/config.yaml").read_text())
    assert after == {**before, "steps": 6, "lr": 0.001}
    assert yaml.safe_load((root / "runs/t1/checkpoints/step_00000006/train_config.yaml").read_text()) == after
    # the earlier config is kept beside the new one, and no temporary file is left
    kept = sorted(p.name for p in (root / "runs/t1").glob("config*.yaml"))
    assert kept == ["config.step_00000004.yaml", "config.yaml"], kept
    assert yaml.safe_load((root / "runs/t1/config.step_00000004.yaml").read_text()) == before
    assert not [p for p in (root / "runs/t1").iterdir() if p.name.startswith(".")]
    rows = [json.loads(line) for line in (root / "runs/t1/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_resume_from_a_checkpoint_path_uses_its_run(run_t1, tmp_path):
    """``--resume PATH`` without ``--out``: the run folder holding PATH, its settings; nothing changed, no warning."""
    root = _copy_run(run_t1, tmp_path)
    res = gdn("train", "--resume", "runs/t1/checkpoints/step_00000002", "--steps", "4", cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "WARNING" not in res.stderr, res.stderr
    assert [p.name for p in (root / "runs/t1").glob("config*.yaml")] == ["config.yaml"]
    assert not (root / "runs/default").exists()


@pytest.mark.parametrize("change, needles", [
    (["--set", "model.hidden_size=64"], ["hidden_size 32 -> 64"]),
    (["--preset", "gdn-h1"], ["layer_pattern 'GG' -> 'GS'", "window_size None -> 64"]),
])
def test_resume_with_another_model_is_one_line(run_t1, change, needles):
    res = gdn("train", "--out", "runs/t1", "--resume", "--steps", "6", *change, cwd=run_t1)
    assert_one_line_error(res, "runs/t1/checkpoints/step_00000004", *needles)


def test_mistyped_model_key_is_an_error(tmp_path):
    write_corpus(tmp_path / "data")
    res = gdn("train", "--data", "data", "--out", "run", "--steps", "1", "--set", "model.hiden_size=64", cwd=tmp_path)
    assert_one_line_error(res, "hiden_size", "hidden_size")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["time_limit", "yaml", "json"])
def test_bad_settings_and_unparsable_config_files(tmp_path, case):
    if case == "time_limit":
        res = gdn("train", "--out", "run", "--set", "time_limit=-3", cwd=tmp_path)
        assert_one_line_error(res, "time_limit", "-3")
        return
    if case == "yaml":
        (tmp_path / "c.yaml").write_text("steps: 10\nlr: 0.001\nseq_len: [16\nbatch_size: 4\n")
        res = gdn("train", "--config", "c.yaml", cwd=tmp_path)
        assert_one_line_error(res, "c.yaml", "line 4")
    else:
        (tmp_path / "c.json").write_text('{\n  "steps": 10,\n  "lr": 0.001,\n}\n')
        res = gdn("train", "--config", "c.json", cwd=tmp_path)
        assert_one_line_error(res, "c.json", "line 4")


@pytest.mark.parametrize("when", ["stopping", "periodic"])
def test_second_sigint_while_saving_lets_the_checkpoint_finish(tmp_path, when):
    """``stopping``: Ctrl-C during training, then again as soon as the checkpoint it asks for is being
    written (its temporary folder appears). ``periodic``: Ctrl-C twice as soon as a periodic
    checkpoint is being written. Either way the checkpoint is completed and verifies, the run stops
    there and exits cleanly. A wide vocabulary makes the save long enough (weights and optimizer
    state of ~80 MB) for the signals to land inside it."""
    if not GDN.exists():
        pytest.skip("the gdn console script is not installed next to this interpreter")
    write_corpus(tmp_path / "data")
    out, save_every = tmp_path / "run", (100000 if when == "stopping" else 3)
    cmd = [str(GDN), "train", "--data", "data", "--out", "run", "--steps", "100000",
           *sets(*TINY, "model.vocab_size=100000", "seq_len=16", "batch_size=2", "log_every=1", "eval_every=100000",
                 f"save_every={save_every}")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root, metrics, saving = out / "checkpoints", out / "metrics.jsonl", False
    try:
        deadline = time.time() + 120
        if when == "stopping":
            while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
                time.sleep(0.05)
            assert proc.poll() is None, proc.communicate()
            proc.send_signal(signal.SIGINT)
        while time.time() < deadline and proc.poll() is None:
            if root.is_dir() and any(p.name.endswith(".partial") for p in os.scandir(root)):
                saving = True
                proc.send_signal(signal.SIGINT)
                if when == "periodic":  # signals that arrive inside one C call reach Python as one
                    time.sleep(0.02)
                    proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.0005)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert saving, "the checkpoint's temporary folder never appeared"
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    ckpts = list_checkpoints(out)
    assert len(ckpts) == 1 and not list(root.glob(".*")), list(root.iterdir())
    manifest = verify(ckpts[0])
    assert manifest["step"] == max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
    if when == "periodic":
        assert manifest["step"] == 3
    assert "while writing a checkpoint" in stderr, stderr
