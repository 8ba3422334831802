"""The shared training loop on a toy regression: micro-batches average to the full batch's gradient,
the norm is clipped, the schedule is lr_factor's, and without save_every nothing is written and no
signal handler is installed."""
from __future__ import annotations

import math
import signal

import pytest
import torch
import torch.nn.functional as F

from gdn.train import LoopSettings, TrainLoop, lr_factor


class Toy(TrainLoop):
    """Linear regression in two micro-batches of 8 rows."""

    def __init__(self, steps: int, grad_clip: float, lr: float = 0.1, bad: set = frozenset(), max_bad_steps: int = 10,
                 adamw: dict | None = None):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=lr) if adamw is None else torch.optim.AdamW(
            model.parameters(), lr=lr, **adamw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 2, steps, 0.0, 3))
        settings = LoopSettings(steps=steps, grad_clip=grad_clip, max_bad_steps=max_bad_steps)
        super().__init__(model, opt, sched, settings, device=torch.device("cpu"))
        self.bad = bad  # 0-based steps whose loss is NaN
        self.x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
        self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
        self.lrs, self.handlers = [], set()

    def micro_batches(self):
        self.lrs.append(self.scheduler.get_last_lr()[0])
        return [(self.x[:8], self.y[:8]), (self.x[8:], self.y[8:])]

    def loss(self, batch):
        self.handlers.add(signal.getsignal(signal.SIGINT))
        loss = F.mse_loss(self.model(batch[0]), batch[1])
        return loss * float("nan") if self.step in self.bad else loss


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_one_step_is_the_full_batch_step_clipped(clip):
    toy = Toy(steps=1, grad_clip=clip)
    w0 = [p.detach().clone() for p in toy.model.parameters()]
    out = toy.fit()
    ref = torch.nn.Linear(4, 1)
    with torch.no_grad():
        for p, w in zip(ref.parameters(), w0):
            p.copy_(w)
    loss = F.mse_loss(ref(toy.x), toy.y)
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref.parameters()))
    scale = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    lr = 0.1 * lr_factor(0, 2, 1, 0.0, 3)
    for p, q in zip(toy.model.parameters(), ref.parameters()):
        assert torch.allclose(p, q - lr * scale * q.grad, atol=1e-6)
    assert out.train_loss == pytest.approx(float(loss.detach()), rel=1e-6)
    assert (out.step, out.metrics, out.checkpoint, out.interrupted) == (1, None, None, False)


@pytest.mark.parametrize("clip", [0.0, 0.05, 100.0], ids=["unbounded", "bites", "above-the-norm"])
def test_clip_in_the_fused_update_trains_as_the_clip_pass(clip):
    """The fused AdamW, clipped inside its update (gdn.train.clip), against the foreach form clipped
    in place: the same weights after four steps, the same norms reported."""
    fused, plain = Toy(steps=4, grad_clip=clip, adamw={"fused": True}), Toy(steps=4, grad_clip=clip,
                                                                          adamw={"foreach": True})
    norms = {}
    for name, toy in (("fused", fused), ("plain", plain)):
        step = toy.train_step
        norms[name] = []
        toy.train_step = lambda step=step, out=norms[name]: (lambda r: (out.append(r[1]), r)[1])(step())
        toy.fit()
    assert norms["fused"] == pytest.approx(norms["plain"], rel=1e-5)
    if clip == 0.05:
        assert all(n > clip for n in norms["plain"])  # (the bound bit at every step)
    for p, q in zip(fused.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_schedule_and_no_signal_handlers_without_checkpoints():
    before = signal.getsignal(signal.SIGINT)
    toy = Toy(steps=8, grad_clip=1.0)
    out = toy.fit()
    assert out.step == 8 and out.train_loss < float(F.mse_loss(torch.zeros_like(toy.y), toy.y))
    assert toy.lrs == pytest.approx([0.1 * lr_factor(s, 2, 8, 0.0, 3) for s in range(8)])
    assert toy.lrs[2:5] == [0.1] * 3  # constant between warmup and the last 3 steps' cosine
    assert toy.handlers == {before} and signal.getsignal(signal.SIGINT) is before


def test_lr_factor_without_decay_is_warmup_then_cosine_to_min_ratio():
    assert lr_factor(0, 4, 20, 0.1) == 0.25 and lr_factor(3, 4, 20, 0.1) == 1.0
    assert lr_factor(4, 4, 20, 0.1) == 1.0 and lr_factor(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert lr_factor(12, 4, 20, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_a_non_finite_step_applies_no_update_and_the_run_goes_on():
    """Steps 2 and 3 have a NaN loss: the weights after them are those after step 1, the schedule
    still advances, and the run trains on to its last step."""
    toy = Toy(steps=6, grad_clip=1.0, bad={1, 2})
    w = []
    step = toy.train_step
    toy.train_step = lambda: (step(), w.append([p.detach().clone() for p in toy.model.parameters()]))[0]
    out = toy.fit()
    assert (out.step, out.trained, out.skipped, out.diverged, out.interrupted) == (6, 6, 2, False, False)
    for a, b, c in zip(w[0], w[1], w[2]):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(w[2][0], w[3][0]) and math.isfinite(out.train_loss)
    assert all(torch.isfinite(p).all() for p in toy.model.parameters())
    assert len(toy.lrs) == 6 and toy.scheduler.last_epoch == 6


def test_max_bad_steps_in_a_row_stop_the_run():
    """Three NaN steps in a row with max_bad_steps = 3 stop the run after the third (as a signal
    would); two in a row, then a good one, do not."""
    toy = Toy(steps=10, grad_clip=1.0, bad={1, 2, 4, 5, 6}, max_bad_steps=3)
    out = toy.fit()
    assert (out.step, out.trained, out.skipped, out.diverged, out.interrupted) == (7, 7, 5, True, True)
    assert all(torch.isfinite(p).all() for p in toy.model.parameters())


def test_without_a_progress_bar_every_logged_step_is_a_line_too(caplog):
    """A run that keeps a metrics log shows each of its metric lines when it has no progress bar."""
    class Log:
        def log(self, step, **values):
            pass

        def close(self):
            pass

    toy = Toy(steps=5, grad_clip=1.0)
    toy.begin = Log
    toy.settings.log_every = 2
    with caplog.at_level("INFO", logger="gdn.train.loop"):
        toy.fit()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [ln.split(":")[0] for ln in lines] == ["step 2/5", "step 4/5", "step 5/5"], lines
    assert all("loss" in ln and "tokens/s" in ln for ln in lines)


def test_a_one_process_run_reads_no_tensor_back_for_its_stop_checks(monkeypatch):
    """Each step's stop checks (signal, time limit, stop_after, divergence) are host values in one
    process: no tensor is made and read back for them (on a GPU such a read waits for the whole
    step's queued kernels before the next step may be launched)."""
    def no_item(self):
        raise AssertionError("a tensor was read back with .item()")

    monkeypatch.setattr(torch.Tensor, "item", no_item)
    toy = Toy(steps=4, grad_clip=1.0)
    toy.settings.stop_after = 3
    out = toy.fit()
    assert (out.step, out.interrupted) == (3, True)


def test_adamw_is_multi_tensor_off_cuda():
    from gdn.train.loop import adamw
    m = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 4))
    opt = adamw(m, 1e-3, 0.1, (0.9, 0.95))
    assert opt.defaults["foreach"] and not opt.defaults["fused"]
    assert sum(len(g["params"]) for g in opt.param_groups) == 3
