"""`gdn train` under torchrun on the CPU (gloo, 2 processes): DDP matches one process at the same
global batch; an FSDP2 distributed checkpoint resumes on a different world size (1 process)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gdn.train import train, verify
from gdn.checkpoint import list_checkpoints
from gdn.train.metrics import read_metrics

from .helpers import SMALL_MODEL, small_config, write_corpus

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(data, out, steps, strategy):
    sets = [f"model.{k}={v}" for k, v in SMALL_MODEL.items()] + [
        "seq_len=32", "batch_size=4", "warmup_steps=2", "lr=0.003", "log_every=1", "eval_every=2", "eval_batches=2",
        "save_every=2", "keep_last=5", "tensorboard=false", "progress=false", "val_fraction=0.25",
        f"distributed={strategy}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "gdn.cli", "train", "--data", str(data), "--out", str(out), "--steps", str(steps)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _losses(out):
    return {r["step"]: r["loss"] for r in read_metrics(Path(out) / "metrics.jsonl") if "loss" in r}


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_processes_match_one_and_resume_on_one(tmp_path, strategy):
    data = write_corpus(tmp_path / "data")
    single = train(small_config(tmp_path / "single", data, steps=4, save_every=2, eval_every=2))
    proc = _torchrun(data, tmp_path / "dist", 2, strategy)
    assert proc.stdout.count("run folder") == 1  # rank-0 reporting only
    ckpt = list_checkpoints(tmp_path / "dist")[-1]
    assert (ckpt / "dcp").is_dir() and verify(ckpt)["world_size"] == 2
    # continue the 2-process run on one process (a different world size)
    resumed = train(small_config(tmp_path / "dist", data, steps=4, save_every=2, eval_every=2), resume=True)
    assert resumed.step == 4
    ref, got = _losses(tmp_path / "single"), _losses(tmp_path / "dist")
    assert sorted(got) == [1, 2, 3, 4]
    for step in range(1, 5):  # same global batch: mean of per-rank means vs one mean, same data order
        assert got[step] == pytest.approx(ref[step], rel=2e-3), (step, got[step], ref[step])
    assert resumed.val_loss == pytest.approx(single.val_loss, rel=2e-3)
