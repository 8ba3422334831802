"""`gdn train --set context_parallel=N` under torchrun on the CPU (gloo): a hybrid preset (gdn-h1:
Gated DeltaNet and sliding-window attention) trains with the losses of one process, alone and
composed with data parallelism, and its checkpoints resume on another number of processes in
both directions."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gdn.checkpoint import list_checkpoints
from gdn.train import TrainConfig, train, verify
from gdn.train.metrics import read_metrics

from ..train.helpers import write_corpus

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
#: gdn-h1 tiny (4 layers G S G S, width 128, window 64); rows of 2 windows of 64 tokens, so each
#: of 2 ranks holds 64 tokens and documents cross the rank boundary.
SETTINGS = dict(preset="gdn-h1", size="tiny", seq_len=64, batch_size=2, warmup_steps=2, lr=1e-3, log_every=1,
                eval_every=STEPS, eval_batches=2, save_every=10, keep_last=5, tensorboard=False, progress=False,
                val_fraction=0.25, device="cpu")


def _config(out, data, **kw):
    return TrainConfig(**{**SETTINGS, "data": str(data), "out": str(out), "steps": STEPS, **kw})


def _torchrun(nproc, data, out, *extra, **settings):
    sets = {**SETTINGS, **settings}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "gdn.cli", "train", "--data", str(data), "--out", str(out), "--steps", str(STEPS), *extra]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _losses(out):
    return {r["step"]: r["loss"] for r in read_metrics(Path(out) / "metrics.jsonl") if "loss" in r}


def _same(got, ref, steps, tol=1e-4):
    assert sorted(got) == list(steps) and set(steps) <= set(ref), (sorted(got), sorted(ref))
    for s in steps:
        assert abs(got[s] - ref[s]) <= tol * abs(ref[s]), (s, got[s], ref[s])


@pytest.mark.slow  # three torchrun launches: `make test-all`
def test_context_parallel_matches_one_process_and_resumes_across_world_sizes(tmp_path):
    """CP = 2 on 2 processes under FSDP2: losses of the 20 steps equal the one-process run's (1e-4);
    its step-10 checkpoint (distributed) finishes on 1 process, and the one-process run's step-10
    checkpoint finishes under torchrun with CP = 2, both on the one-process losses."""
    data = write_corpus(tmp_path / "data")
    single = train(_config(tmp_path / "single", data))
    ref = _losses(tmp_path / "single")
    # CP = 2, stopping after step 10 (checkpoint), then resumed on one process
    proc = _torchrun(2, data, tmp_path / "cp", context_parallel=2, stop_after=10, distributed="fsdp")
    assert "(1 data x 2 context parallel, gather attention)" in proc.stdout + proc.stderr
    ckpt = list_checkpoints(tmp_path / "cp")[-1]
    assert ckpt.name == "step_00000010" and (ckpt / "dcp").is_dir() and verify(ckpt)["world_size"] == 2
    resumed = train(_config(tmp_path / "cp", data), resume=True)
    assert resumed.step == STEPS
    _same(_losses(tmp_path / "cp"), ref, range(1, STEPS + 1))
    assert resumed.val_loss == pytest.approx(single.val_loss, rel=1e-4)
    # the one-process checkpoint of step 10, resumed on 2 processes with CP = 2
    _torchrun(2, data, tmp_path / "back", "--resume", str(tmp_path / "single" / "checkpoints" / "step_00000010"),
              context_parallel=2, distributed="fsdp")
    _same(_losses(tmp_path / "back"), ref, range(11, STEPS + 1))


@pytest.mark.slow  # four processes on two cores: `make test-all`
def test_data_times_context_parallel(tmp_path):
    """4 processes = 2 data-parallel groups x CP = 2 under DDP: the losses of one process accumulating the same
    two rows per step (grad_accum = 2), to 1e-4."""
    data = write_corpus(tmp_path / "data")
    train(_config(tmp_path / "single", data, batch_size=4, grad_accum=2))
    proc = _torchrun(4, data, tmp_path / "dpcp", batch_size=4, context_parallel=2)
    assert "(2 data x 2 context parallel, gather attention)" in proc.stdout + proc.stderr
    _same(_losses(tmp_path / "dpcp"), _losses(tmp_path / "single"), range(1, STEPS + 1))


def test_ring_attention_trains_like_one_process(tmp_path):
    """A hybrid with global attention (qwen3next tiny: G G G A) under CP = 2 with
    ``context_parallel_attention=ring``: the 20 losses of one process, to 1e-4."""
    data = write_corpus(tmp_path / "data")
    train(_config(tmp_path / "single", data, preset="qwen3next"))
    proc = _torchrun(2, data, tmp_path / "ring", preset="qwen3next", context_parallel=2,
                     context_parallel_attention="ring")
    assert "(1 data x 2 context parallel, ring attention)" in proc.stdout + proc.stderr
    _same(_losses(tmp_path / "ring"), _losses(tmp_path / "single"), range(1, STEPS + 1))


def test_context_parallel_setting_is_checked(tmp_path):
    """context_parallel must be a positive int dividing the number of processes."""
    with pytest.raises(ValueError, match="context_parallel must be a positive int"):
        _config(tmp_path / "x", tmp_path, context_parallel=0)
    with pytest.raises(ValueError, match="context_parallel_attention must be one of"):
        _config(tmp_path / "x", tmp_path, context_parallel_attention="all")
    data = write_corpus(tmp_path / "data")
    with pytest.raises(ValueError, match=r"context_parallel \(2\) must divide the number of processes \(1\)"):
        train(_config(tmp_path / "one", data, context_parallel=2))
