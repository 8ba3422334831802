"""Resume equals an uninterrupted run, checkpoints are verified, signals save and exit cleanly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gdn.train import CheckpointError, Trainer, train, verify
from gdn.checkpoint import list_checkpoints, resolve
from gdn.train.metrics import read_metrics

from .helpers import small_config, write_corpus

ROOT = Path(__file__).resolve().parents[2]


def _losses(out):
    return {r["step"]: r["loss"] for r in read_metrics(Path(out) / "metrics.jsonl") if "loss" in r}


def _vals(out):
    return {r["step"]: r["val_loss"] for r in read_metrics(Path(out) / "metrics.jsonl") if "val_loss" in r}


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_resume_matches_uninterrupted_run_exactly(tmp_path, grad_accum):
    data = write_corpus(tmp_path / "data")
    full = train(small_config(tmp_path / "full", data, grad_accum=grad_accum))
    assert full.step == 6 and not full.interrupted
    part = train(small_config(tmp_path / "part", data, grad_accum=grad_accum, stop_after=3))
    assert part.step == 3 and part.interrupted
    assert [p.name for p in list_checkpoints(tmp_path / "part")] == ["step_00000003"]
    resumed = train(small_config(tmp_path / "part", data, grad_accum=grad_accum), resume=True)
    assert resumed.step == 6
    a, b = _losses(tmp_path / "full"), _losses(tmp_path / "part")
    assert sorted(b) == list(range(1, 7))  # metrics continue, no duplicated steps
    for step in range(1, 7):
        assert a[step] == b[step], (step, a[step], b[step])
    assert _vals(tmp_path / "full")[6] == _vals(tmp_path / "part")[6]
    wa = load_file(str(tmp_path / "full/checkpoints/step_00000006/model.safetensors"))
    wb = load_file(str(tmp_path / "part/checkpoints/step_00000006/model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_corrupted_and_partial_checkpoints_are_reported(tmp_path):
    data = write_corpus(tmp_path / "data")
    train(small_config(tmp_path / "run", data, steps=4, save_every=2, keep_last=2))
    ckpts = list_checkpoints(tmp_path / "run")
    assert [p.name for p in ckpts] == ["step_00000002", "step_00000004"]
    manifest = verify(ckpts[-1])
    assert {"model.safetensors", "trainer.pt", "config.json", "tokenizer.json"} <= set(manifest["files"])
    # flip one byte of the weights: detected
    w = ckpts[-1] / "model.safetensors"
    raw = bytearray(w.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    w.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="SHA-256"):
        verify(ckpts[-1])
    with pytest.raises(CheckpointError, match="SHA-256"):
        train(small_config(tmp_path / "run", data, steps=6), resume=True)
    # truncated file and missing manifest (a partial write)
    t = ckpts[0] / "trainer.pt"
    t.write_bytes(t.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        resolve(ckpts[0], tmp_path / "run")
    (ckpts[0] / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="partial"):
        verify(ckpts[0])


def test_keep_last_and_fresh_run_is_not_resumed(tmp_path):
    data = write_corpus(tmp_path / "data")
    res = train(small_config(tmp_path / "run", data, steps=5, save_every=1, keep_last=2, eval_every=5))
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_00000004", "step_00000005"]
    assert res.checkpoint.name == "step_00000005"
    assert not list((tmp_path / "run/checkpoints").glob(".*"))  # no temporary folders left
    with pytest.raises(ValueError, match="already holds checkpoints"):
        Trainer(small_config(tmp_path / "run", data, steps=5)).run()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_saves_checkpoint_and_exits_cleanly(tmp_path, sig):
    data = write_corpus(tmp_path / "data")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gdn.cli", "train", "--data", str(data), "--out", str(out), "--steps", "100000",
           "--set", "model.hidden_size=32", "--set", "model.num_hidden_layers=2", "--set", "model.head_dim=16",
           "--set", "seq_len=32", "--set", "batch_size=2", "--set", "log_every=1", "--set", "eval_every=100000",
           "--set", "save_every=100000", "--set", "tensorboard=false", "--set", "progress=false",
           "--set", "val_fraction=0.25"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    ckpts = list_checkpoints(out)
    assert len(ckpts) == 1
    manifest = verify(ckpts[0])
    steps = max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
    assert manifest["step"] == steps >= 2
    assert signal.Signals(sig).name in stderr + stdout


def test_corrupted_checkpoint_names_the_valid_older_ones(tmp_path):
    data = write_corpus(tmp_path / "data")
    out = tmp_path / "run"
    train(small_config(out, data, steps=6, save_every=2, keep_last=3, eval_every=6))
    newest = out / "checkpoints/step_00000006/model.safetensors"
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    newest.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        resolve(True, out)
    msg = str(e.value)
    assert "step_00000006" in msg and "model.safetensors" in msg and "\n" not in msg, msg
    assert "valid older checkpoints: step_00000004, step_00000002" in msg, msg
    # an older one that is also damaged is not offered
    (out / "checkpoints/step_00000002/trainer.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"valid older checkpoints: step_00000004;") as e:
        resolve(True, out)
    (out / "checkpoints/step_00000004/manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no older checkpoint is valid"):
        resolve(True, out)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoint_files_follow_the_umask(tmp_path, umask):
    data = write_corpus(tmp_path / "data")
    old = os.umask(umask)
    try:
        res = train(small_config(tmp_path / "run", data, steps=1, eval_every=1))
    finally:
        os.umask(old)
    files = [p for p in res.checkpoint.rglob("*") if p.is_file()]
    assert {"model.safetensors", "trainer.pt", "manifest.json"} <= {p.name for p in files}
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


def test_resume_with_another_model_names_the_fields(tmp_path):
    data = write_corpus(tmp_path / "data")
    train(small_config(tmp_path / "run", data, steps=2, save_every=2, eval_every=2))
    cfg = small_config(tmp_path / "run", data, steps=4)
    cfg.model["hidden_size"] = 64
    cfg.model["num_hidden_layers"] = 3
    with pytest.raises(ValueError) as e:
        Trainer(cfg, resume=True)
    msg = str(e.value)
    assert "step_00000002" in msg and "hidden_size 32 -> 64" in msg and "num_hidden_layers 2 -> 3" in msg, msg
    assert "layer_pattern 'GG' -> 'GGG'" in msg and "\n" not in msg, msg
