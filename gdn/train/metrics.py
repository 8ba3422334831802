"""Metrics: one JSON object per line, TensorBoard scalars, and the loss-curve PNG."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)


class MetricsLog:
    """Append ``{"step": ..., name: value, ...}`` lines to ``OUT/metrics.jsonl`` (and TensorBoard
    under ``OUT/tb`` when ``tensorboard``). ``truncate_after`` drops lines past a resumed step."""

    def __init__(self, out: str | Path, tensorboard: bool = True, truncate_after: int | None = None):
        self.path = Path(out) / "metrics.jsonl"
        if truncate_after is not None and self.path.exists():
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= truncate_after]
            self.path.write_text("".join(line + "\n" for line in keep))
        elif truncate_after is None and self.path.exists():
            self.path.unlink()
        self._f = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(out) / "tb"))

    def log(self, step: int, **values) -> None:
        """Write one line; numbers also go to TensorBoard."""
        self._f.write(json.dumps({"step": step, **values}) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        """Flush and close."""
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    """The lines of a ``metrics.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss_curve(metrics: str | Path, png: str | Path, baseline_bpb: float | None = None) -> Path:
    """Training loss (nats/token) and validation bits per byte against the step, with the unigram
    baseline as a dashed line; written to ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"], r["val_bpb"]) for r in rows if "val_loss" in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        a.plot(*zip(*train), label="train", lw=1)
    if val:
        a.plot([v[0] for v in val], [v[1] for v in val], "o-", label="validation")
        b.plot([v[0] for v in val], [v[2] for v in val], "o-", color="C1", label="validation")
    if baseline_bpb is not None:
        b.axhline(baseline_bpb, ls="--", color="gray", label=f"unigram {baseline_bpb:.2f}")
    a.set(xlabel="step", ylabel="loss (nats / token)", title="loss")
    b.set(xlabel="step", ylabel="bits per byte", title="validation bits per byte")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
