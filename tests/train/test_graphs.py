"""GraphedStep's checks, which run before any CUDA work: a clear error for an optimizer that cannot
skip its update on the device, a bad warmup, no CUDA device, and a batch of another shape than the
first (the replays on a GPU: tests/gpu/test_train_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from gdn.train.graphs import GraphedStep


def test_no_cuda_device_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    m = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        GraphedStep(m, torch.optim.AdamW(m.parameters(), fused=True))


def test_optimizer_and_warmup_are_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="found_inf.*got SGD"):
        GraphedStep(m, torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="got AdamW \\(fused=None\\)"):
        GraphedStep(m, torch.optim.AdamW(m.parameters(), foreach=True))
    with pytest.raises(ValueError, match="warmup must be an int >= 1, got 0"):
        GraphedStep(m, torch.optim.AdamW(m.parameters(), fused=True), warmup=0)


def test_every_batch_has_the_first_ones_shape(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)
    m = torch.nn.Linear(2, 2)
    gs = GraphedStep(m, torch.optim.AdamW(m.parameters(), fused=True))
    first = {"ids": torch.zeros(2, 8, dtype=torch.long)}
    gs._take(first)
    assert gs.static["ids"] is not first["ids"] and torch.equal(gs.static["ids"], first["ids"])
    gs._take({"ids": torch.ones(2, 8, dtype=torch.long)})
    assert torch.equal(gs.static["ids"], torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"batch\['ids'\] must be \(2, 8\) torch.int64 as at the first step, got \(2, 9\)"):
        gs._take({"ids": torch.zeros(2, 9, dtype=torch.long)})
    with pytest.raises(ValueError, match="batch must hold \\['ids'\\]"):
        gs._take({"x": torch.zeros(2, 8, dtype=torch.long)})
