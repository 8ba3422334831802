"""One intra-op thread per test process: the models are tiny and pytest -n 2 already fills the cores."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
