"""``gdn mqar``: multi-query associative recall (Zoology) for every token mixer.

2-layer models of each mixer letter (``L`` linear attention, ``M`` gated linear attention,
``D`` DeltaNet, ``G`` Gated DeltaNet, ``A`` softmax attention) are trained on MQAR at every model
width and number of key-value pairs, for every learning rate; the table reports, per cell, the
test accuracy over query positions of the best learning rate. Runs are spread over worker
processes (CPU) and written to ``OUT/results.json``, ``OUT/table.md`` and ``OUT/mqar.png``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data import mqar_batch
from .config import merge, parse_set, read_config_file

logger = logging.getLogger(__name__)

MIXER_NAMES = {"L": "linear attention", "M": "gated linear attn", "D": "DeltaNet", "G": "Gated DeltaNet",
               "A": "softmax attention"}


@dataclass
class MQARConfig:
    """Grid and training budget of ``gdn mqar``."""

    mixers: str = "LMDGA"  #: layer letters to compare
    widths: list = field(default_factory=lambda: [64])  #: model widths (hidden_size)
    num_pairs: list = field(default_factory=lambda: [4, 8])  #: key-value pairs per sequence
    lrs: list = field(default_factory=lambda: [1e-3, 3e-3])  #: learning rates swept
    seq_len: int = 64  #: tokens per sequence
    vocab_size: int = 64  #: ids (keys from the lower half, values from the upper)
    num_heads: int = 2  #: heads of every mixer (head size = width / heads)
    train_examples: int = 8192  #: training sequences per cell (fixed per seed)
    test_examples: int = 512  #: held-out sequences
    epochs: int = 2  #: passes over the training sequences
    batch_size: int = 64
    warmup_frac: float = 0.1  #: share of steps with linear warmup (then cosine)
    weight_decay: float = 0.1
    alpha: float = 0.01  #: power-law exponent of the query gaps
    seed: int = 0
    device: str = "auto"
    workers: int = 0  #: parallel runs (0 = number of CPU cores on CPU, 1 on CUDA)
    out: str = "runs/mqar"

    def __post_init__(self):
        bad = sorted(set(self.mixers) - set(MIXER_NAMES))
        if not self.mixers or bad:
            raise ValueError(f"mixers must be letters of {''.join(MIXER_NAMES)}, got {self.mixers!r}")
        for name in ("widths", "num_pairs", "lrs"):
            v = getattr(self, name)
            if not isinstance(v, list) or not v:
                raise ValueError(f"{name} must be a non-empty list, got {v!r}")
        for w in self.widths:
            if w % self.num_heads or (w // self.num_heads) % 2:
                raise ValueError(f"every width must be num_heads ({self.num_heads}) x an even head size, got {w}")
        for p in self.num_pairs:
            if self.seq_len < 4 * p or self.vocab_size < 2 * (p + 1):
                raise ValueError(f"num_pairs {p} needs seq_len >= {4 * p} and vocab_size >= {2 * (p + 1)}")


#: Named grids. cpu-small: <= 10 minutes on 2 CPU cores. paper: Zoology's scale, for a GPU.
PRESETS = {
    "cpu-small": dict(mixers="LMDGA", widths=[32, 64], num_pairs=[8], lrs=[3e-3, 1e-2], seq_len=64,
                      vocab_size=64, train_examples=12288, test_examples=512, epochs=2, batch_size=64),
    "paper": dict(mixers="LMDGA", widths=[64, 128, 256, 512], num_pairs=[4, 8, 16, 32, 64],
                  lrs=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2], seq_len=256, vocab_size=8192, train_examples=100_000,
                  test_examples=3000, epochs=64, batch_size=256, workers=1),
}


def mqar_config(preset: str = "cpu-small", file=None, sets=None, **flags) -> MQARConfig:
    """The preset's grid, overridden by a config file, then flags (``None`` ignored), then ``--set`` items."""
    if preset not in PRESETS:
        raise ValueError(f"unknown MQAR preset {preset!r}; choose one of {sorted(PRESETS)}")
    data = merge(dict(PRESETS[preset]), read_config_file(file) if file else {})
    data = merge(data, {k: v for k, v in flags.items() if v is not None})
    data = merge(data, parse_set(sets))
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(MQARConfig)})
    if unknown:
        raise ValueError(f"unknown MQAR config keys {unknown}")
    return MQARConfig(**data)


def model_config(letter: str, width: int, cfg: MQARConfig):
    """GDNConfig of a 2-layer model of one mixer at one width."""
    from ..models import GDNConfig

    head = width // cfg.num_heads
    return GDNConfig(vocab_size=cfg.vocab_size, hidden_size=width, num_hidden_layers=2, layer_pattern=letter * 2,
                     num_heads=cfg.num_heads, head_dim=head, expand_v=1.0, num_attention_heads=cfg.num_heads,
                     num_key_value_heads=cfg.num_heads, intermediate_size=2 * width, max_position_embeddings=cfg.seq_len)


@torch.no_grad()
def accuracy(model, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 256) -> float:
    """Share of query positions (``targets != -100``) where the argmax equals the target."""
    model.eval()
    hit = total = 0
    for i in range(0, len(inputs), batch_size):
        logits = model(input_ids=inputs[i : i + batch_size], use_cache=False).logits
        t = targets[i : i + batch_size]
        q = t != -100
        hit += int((logits.argmax(-1)[q] == t[q]).sum())
        total += int(q.sum())
    model.train()
    return hit / max(total, 1)


def train_one(cfg: MQARConfig, letter: str, width: int, pairs: int, lr: float) -> dict:
    """Train one model on one cell; ``{mixer, width, num_pairs, lr, accuracy, final_loss, seconds}``."""
    from ..models import GDNForCausalLM, param_groups

    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    t0 = time.time()
    x, y = mqar_batch(cfg.train_examples, cfg.seq_len, pairs, cfg.vocab_size, alpha=cfg.alpha, seed=cfg.seed * 1000 + pairs)
    xt, yt = mqar_batch(cfg.test_examples, cfg.seq_len, pairs, cfg.vocab_size, alpha=cfg.alpha,
                        seed=cfg.seed * 1000 + pairs + 10**6)
    x, y, xt, yt = x.to(device), y.to(device), xt.to(device), yt.to(device)
    torch.manual_seed(cfg.seed)
    model = GDNForCausalLM(model_config(letter, width, cfg)).to(device)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=lr, betas=(0.9, 0.98))
    steps = cfg.epochs * math.ceil(cfg.train_examples / cfg.batch_size)
    warm = max(1, int(cfg.warmup_frac * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    gen = torch.Generator().manual_seed(cfg.seed)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    loss = torch.zeros(())
    for _ in range(cfg.epochs):
        order = torch.randperm(cfg.train_examples, generator=gen).to(device)
        for i in range(0, cfg.train_examples, cfg.batch_size):
            idx = order[i : i + cfg.batch_size]
            with amp:
                logits = model(input_ids=x[idx], use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y[idx].reshape(-1), ignore_index=-100)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    with amp:
        acc = accuracy(model, xt, yt)
    return dict(mixer=letter, width=width, num_pairs=pairs, lr=lr, accuracy=acc, final_loss=float(loss.detach()),
                seconds=time.time() - t0)


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)


def _run_cell(args):
    return train_one(*args)


def best_by_cell(results: list[dict]) -> dict:
    """``{(mixer, width, pairs): best result over learning rates}``."""
    best = {}
    for r in results:
        key = (r["mixer"], r["width"], r["num_pairs"])
        if key not in best or r["accuracy"] > best[key]["accuracy"]:
            best[key] = r
    return best


def format_table(results: list[dict]) -> str:
    """Markdown table: a row per mixer, a column per (width, pairs), best accuracy over learning rates."""
    best = best_by_cell(results)
    mixers = list(dict.fromkeys(r["mixer"] for r in results))
    cols = sorted({(w, p) for _, w, p in best})
    head = "| mixer | " + " | ".join(f"d={w}, {p} kv" for w, p in cols) + " |"
    lines = [head, "|---|" + "---:|" * len(cols)]
    for m in mixers:
        cells = [f"{best[(m, w, p)]['accuracy']:.3f}" if (m, w, p) in best else "—" for w, p in cols]
        lines.append(f"| {MIXER_NAMES[m]} ({m}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], png: str | Path) -> Path:
    """Accuracy vs number of pairs, one panel per width, one line per mixer (best lr)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_by_cell(results)
    widths = sorted({w for _, w, _ in best})
    fig, axes = plt.subplots(1, len(widths), figsize=(4.2 * len(widths), 3.6), squeeze=False)
    for ax, w in zip(axes[0], widths):
        for m in dict.fromkeys(r["mixer"] for r in results):
            pts = sorted((p, r["accuracy"]) for (mm, ww, p), r in best.items() if mm == m and ww == w)
            ax.plot(*zip(*pts), "o-", label=MIXER_NAMES[m])
        ax.set(title=f"width {w}", xlabel="key-value pairs", ylabel="accuracy", ylim=(-0.02, 1.02))
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def run_mqar(cfg: MQARConfig) -> list[dict]:
    """Every (mixer, width, pairs, lr) run; writes results.json, table.md and mqar.png under ``cfg.out``."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(out, "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    jobs = [(cfg, m, w, p, lr) for w in cfg.widths for p in cfg.num_pairs for m in cfg.mixers for lr in cfg.lrs]
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    workers = cfg.workers or (1 if cuda else (os.cpu_count() or 1))
    t0 = time.time()
    results = []
    if workers == 1:
        for j in jobs:
            results.append(train_one(*j))
            logger.info("mqar %s", results[-1])
    else:
        import multiprocessing as mp

        threads = max(1, (os.cpu_count() or 1) // workers)
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                                 initargs=(threads,)) as pool:
            for r in pool.map(_run_cell, jobs):
                results.append(r)
                logger.info("mqar %s", r)
    logger.info("mqar: %d runs in %.0f s", len(results), time.time() - t0)
    Path(out, "results.json").write_text(json.dumps(results, indent=1))
    Path(out, "table.md").write_text(format_table(results) + "\n")
    plot(results, out / "mqar.png")
    return results
