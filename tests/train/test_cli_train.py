"""``gdn train`` through the real console script, in a subprocess: a second Ctrl-C while a checkpoint
is written lets the checkpoint finish."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
