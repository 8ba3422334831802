"""``gdn mqar``: multi-query associative recall (Zoology) for every token mixer.

2-layer models of each chosen mixer letter (every recurrent mixer and ``A`` softmax attention:
:data:`LETTERS`; the presets compare ``L`` linear attention, ``M`` gated linear attention, ``D``
DeltaNet, ``G`` Gated DeltaNet and ``A``) are trained on MQAR at every model width and number of
key-value pairs, for every learning rate; the table reports, per cell, the test accuracy over
query positions of the best learning rate. Each run goes through the shared training loop
(:class:`gdn.train.loop.TrainLoop`: AdamW, :func:`gdn.train.loop.lr_factor`, clipping) in memory,
without checkpoints. Runs are spread over worker processes (CPU) and written to
``OUT/results.json``, ``OUT/table.md`` and ``OUT/mqar.png``.

The table ends with :func:`delta_rule_ahead`'s verdict: whether D and G are above L in every
column. The presets start the models with :data:`RECIPE` (``beta_offset``: β of D/G layers starts
near 0.05; ``decay_init``: slow M/G decay gates); with ``beta_offset=0`` and ``decay_init=None``
every layer starts as its published initialisation. ``cpu-small`` uses one head per layer: there D
and G learn the lookup within its 2000 steps on every seed measured and linear attention, slower to
learn it with one head, is far behind (docs/TRAINING.md, "MQAR", says what that gap is and is not).
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
from ..data.mqar import mqar_mixture
from ..models.registry import MIXERS, letters, mixer
from . import distributed as D
from .config import merge, parse_set, read_config_file
from .loop import LoopSettings, TrainLoop, adamw, autocast_for, lr_factor

logger = logging.getLogger(__name__)

#: The mixers ``gdn mqar`` runs: those with a step cost in :data:`gdn.models.registry.MIXERS`
#: (every recurrent mixer and global attention; MQAR's config sets no attention window).
LETTERS = letters(lambda s: s.step_cost is not None)

#: Table and plot name of each letter :data:`LETTERS` holds.
MIXER_NAMES = {c: MIXERS[c].display for c in LETTERS}

#: The verdict under the table: the delta-rule mixers against linear attention.
DELTA_RULE, BASELINE = "DG", "L"


@dataclass
class MQARConfig:
    """Grid and training budget of ``gdn mqar``."""

    mixers: str = "LMDGA"  #: layer letters to compare
    widths: list = field(default_factory=lambda: [64])  #: model widths (hidden_size)
    num_pairs: list = field(default_factory=lambda: [4, 8])  #: key-value pairs per sequence
    train_pairs: list | None = None  #: pair counts of a training mixture (None: each cell trains on its own)
    lrs: list = field(default_factory=lambda: [1e-3, 3e-3])  #: learning rates swept
    seq_len: int = 64  #: tokens per sequence
    vocab_size: int = 64  #: ids (keys from the lower half, values from the upper)
    num_heads: int = 2  #: heads of every mixer (head size = width / heads)
    train_examples: int = 8192  #: training sequences per cell (fixed per seed)
    test_examples: int = 512  #: held-out sequences
    epochs: int = 2  #: passes over the training sequences
    batch_size: int = 64
    warmup_frac: float = 0.1  #: share of steps with linear warmup
    decay_frac: float = 1.0  #: share of steps, at the end, of cosine decay to 0 (constant lr before it)
    weight_decay: float = 0.1
    alpha: float = 0.01  #: power-law exponent of the query gaps
    beta_offset: float = 0.0  #: added to the β pre-activation of D and G layers (GDNConfig.beta_offset)
    decay_init: list | None = None  #: [A_min, A_max, dt_min, dt_max] of the M and G decay gates (None: the layers')
    seed: int = 0
    device: str = "auto"
    workers: int = 0  #: parallel runs (0 = number of CPU cores on CPU, 1 on CUDA)
    out: str = "runs/mqar"

    def __post_init__(self):
        if isinstance(self.decay_init, list):  # from a config file: the same value as a preset's tuple
            self.decay_init = tuple(self.decay_init)
        bad = sorted(set(self.mixers) - set(LETTERS))
        if not self.mixers or bad:
            raise ValueError(f"mixers must be letters of {LETTERS}, got {self.mixers!r}")
        for name in ("widths", "num_pairs", "lrs"):
            v = getattr(self, name)
            if not isinstance(v, list) or not v:
                raise ValueError(f"{name} must be a non-empty list, got {v!r}")
        for w in self.widths:
            if w % self.num_heads or (w // self.num_heads) % 2:
                raise ValueError(f"every width must be num_heads ({self.num_heads}) x an even head size, got {w}")
        tp = self.train_pairs
        if tp is not None and (not isinstance(tp, list) or not tp
                               or not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in tp)):
            raise ValueError(f"train_pairs must be a non-empty list of positive ints or None, got {tp!r}")
        for p in self.num_pairs + (tp or []):
            if self.seq_len < 4 * p or self.vocab_size < 2 * (p + 1):
                raise ValueError(f"num_pairs and train_pairs: {p} pairs need seq_len >= {4 * p} and "
                                 f"vocab_size >= {2 * (p + 1)}")
        for name in ("warmup_frac", "decay_frac"):
            f = getattr(self, name)
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
                raise ValueError(f"{name} must be a number in [0, 1], got {f!r}")
        b = self.beta_offset
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise ValueError(f"beta_offset must be a finite number, got {b!r}")
        d = self.decay_init
        if d is not None and not (isinstance(d, (list, tuple)) and len(d) == 4
                                  and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in d)
                                  and 0 < d[0] <= d[1] and 0 < d[2] <= d[3]):
            raise ValueError(f"decay_init must be [A_min, A_max, dt_min, dt_max] with 0 < A_min <= A_max and "
                             f"0 < dt_min <= dt_max, or None, got {d!r}")


#: The initialisation recipe both presets use (measured at cpu-small's scale; docs/TRAINING.md, "MQAR"):
#: β of the D/G layers starts at sigmoid(-3) ≈ 0.05 instead of 0.5, so the delta rule starts close to
#: linear attention and learns to write harder; the decay gates of M/G start slow (A ∈ U(0.01, 1),
#: dt log-uniform in [1e-3, 1e-2]: at most ≈ 1 % forgetting per token instead of up to 80 %).
RECIPE = dict(beta_offset=-3.0, decay_init=(0.01, 1.0, 1e-3, 1e-2))

#: Named grids. cpu-small: one column (width 32 with one head per layer, so head size 32; 16 pairs; 255
#: key ids) trained for 2000 steps of 64 fresh sequences (constant lr after a 5 % warmup, then a cosine
#: over the last 20 %), ≈ 13 CPU-minutes, 9 minutes on 2 free cores. paper: Zoology's scale, for a GPU.
PRESETS = {
    "cpu-small": dict(mixers="LMDGA", widths=[32], num_heads=1, num_pairs=[16], lrs=[3e-3], seq_len=64,
                      vocab_size=512, train_examples=128000, test_examples=512, epochs=1, batch_size=64,
                      warmup_frac=0.05, decay_frac=0.2, **RECIPE),
    "paper": dict(mixers="LMDGA", widths=[64, 128, 256, 512], num_pairs=[4, 8, 16, 32, 64],
                  lrs=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2], seq_len=256, vocab_size=8192, train_examples=100_000,
                  test_examples=3000, epochs=64, batch_size=256, workers=1, **RECIPE),
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
                     num_key_value_heads=cfg.num_heads, intermediate_size=2 * width,
                     max_position_embeddings=cfg.seq_len,
                     beta_offset=float(cfg.beta_offset) if "beta_offset" in mixer(letter).options else 0.0)


def build_model(letter: str, width: int, cfg: MQARConfig):
    """The 2-layer model of one mixer at one width, with the recipe's initialisation: the layers that
    read ``beta_offset`` (``D``, ``G``) get ``cfg.beta_offset`` through their config, and with
    ``cfg.decay_init`` the scalar decay gates (``M``, ``G``) are drawn as
    :func:`gdn.layers.recurrent.mamba_gate_init` does from those ranges."""
    from ..layers.recurrent import RecurrentMixer, mamba_gate_init
    from ..models import GDNForCausalLM

    model = GDNForCausalLM(model_config(letter, width, cfg))
    for m in model.modules():
        if cfg.decay_init is not None and isinstance(m, RecurrentMixer) and m.has_decay:
            a_min, a_max, dt_min, dt_max = (float(v) for v in cfg.decay_init)
            A_log, dt_bias = mamba_gate_init(m.num_v_heads, dt_min=dt_min, dt_max=dt_max, a_min=a_min, a_max=a_max)
            with torch.no_grad():
                m.A_log.copy_(A_log)
                m.dt_bias.copy_(dt_bias)
    return model


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


def schedule_steps(steps: int, warmup_frac: float, decay_frac: float) -> tuple[int, int]:
    """``(warmup, decay)`` steps of :func:`gdn.train.loop.lr_factor` for a run of ``steps``: linear
    warmup over the first ``warmup_frac`` of the steps (at least one), constant 1, then a cosine to
    0 over the last ``decay_frac`` (at least one step, at most the steps after warmup;
    ``decay_frac=1`` is warmup then cosine)."""
    warmup = max(1, int(warmup_frac * steps))
    return warmup, max(1, min(steps - warmup, int(round(decay_frac * steps))))


class CellRun(TrainLoop):
    """One MQAR cell (mixer, width, pairs, lr) in the shared :class:`TrainLoop`: the training
    sequences held in memory, ``epochs`` passes over them in a fresh seeded order each, cross entropy
    at the query positions, clipping at 1, AdamW (betas 0.9, 0.98) with :func:`schedule_steps`'s
    schedule, bf16 autocast on CUDA; the validation is the test accuracy (:func:`accuracy`). No
    checkpoints, no metrics log."""

    def __init__(self, cfg: MQARConfig, letter: str, width: int, pairs: int, lr: float):
        device = D.pick_device(cfg.device)
        if cfg.train_pairs is None:
            x, y = mqar_batch(cfg.train_examples, cfg.seq_len, pairs, cfg.vocab_size, alpha=cfg.alpha,
                              seed=cfg.seed * 1000 + pairs)
        else:
            x, y = mqar_mixture(cfg.train_examples, cfg.seq_len, cfg.train_pairs, cfg.vocab_size, alpha=cfg.alpha,
                                seed=cfg.seed)
        xt, yt = mqar_batch(cfg.test_examples, cfg.seq_len, pairs, cfg.vocab_size, alpha=cfg.alpha,
                            seed=cfg.seed * 1000 + pairs + 10**6)
        self.x, self.y, self.xt, self.yt = x.to(device), y.to(device), xt.to(device), yt.to(device)
        torch.manual_seed(cfg.seed)
        model = build_model(letter, width, cfg).to(device)
        optimizer = adamw(model, lr, cfg.weight_decay, (0.9, 0.98))
        self.steps_per_epoch = math.ceil(cfg.train_examples / cfg.batch_size)
        steps = cfg.epochs * self.steps_per_epoch
        warmup, decay = schedule_steps(steps, cfg.warmup_frac, cfg.decay_frac)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup, steps, 0.0, decay))
        super().__init__(model, optimizer, scheduler, LoopSettings(steps=steps, grad_clip=1.0), device=device,
                         autocast=autocast_for(device), tokens_per_step=cfg.batch_size * cfg.seq_len)
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.epoch, self.order = -1, None

    def micro_batches(self) -> list:
        """The step's sequences ``[(ids, targets)]``: the next slice of this epoch's order."""
        epoch, i = divmod(self.step, self.steps_per_epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self.order = torch.randperm(self.cfg.train_examples, generator=self.generator).to(self.device)
        idx = self.order[i * self.cfg.batch_size : (i + 1) * self.cfg.batch_size]
        return [(self.x[idx], self.y[idx])]

    def loss(self, batch) -> torch.Tensor:
        """Cross entropy at the query positions (``targets != -100``; targets are not shifted)."""
        ids, targets = batch
        logits = self.model(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)

    def validate(self) -> dict:
        """``{"accuracy": ...}`` on the held-out sequences."""
        with self.autocast():
            return {"accuracy": accuracy(self.model, self.xt, self.yt)}


def train_one(cfg: MQARConfig, letter: str, width: int, pairs: int, lr: float) -> dict:
    """Train one model on one cell; ``{mixer, width, num_pairs, lr, accuracy, final_loss, seconds}``."""
    t0 = time.time()
    out = CellRun(cfg, letter, width, pairs, lr).fit()
    return dict(mixer=letter, width=width, num_pairs=pairs, lr=lr, accuracy=out.metrics["accuracy"],
                final_loss=out.train_loss, seconds=time.time() - t0)


#: Seconds per training step relative to linear attention (:attr:`gdn.models.registry.MixerSpec.step_cost`):
#: used only to start the longest runs first.
STEP_COST = {c: MIXERS[c].step_cost for c in LETTERS}


def run_cost(letter: str, width: int, pairs: int) -> float:
    """Relative CPU cost of one run (for ordering the jobs; every run of a grid has the same steps)."""
    return STEP_COST[letter] * width ** 0.5


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


def delta_rule_ahead(results: list[dict]) -> dict:
    """``{(width, pairs): True/False}``: whether both delta-rule mixers (``D`` and ``G``) reached a
    higher best accuracy than linear attention (``L``) in that column; a column where any of the
    three was not run has no verdict. This is the claim ``--preset cpu-small`` is meant to show in
    every column for every seed."""
    best = best_by_cell(results)
    out = {}
    for w, p in sorted({(w, p) for _, w, p in best}):
        if (BASELINE, w, p) not in best:
            continue
        if all((m, w, p) in best for m in DELTA_RULE):
            out[(w, p)] = all(best[(m, w, p)]["accuracy"] > best[(BASELINE, w, p)]["accuracy"] for m in DELTA_RULE)
    return out


def format_table(results: list[dict]) -> str:
    """Markdown table: a row per mixer, a column per (width, pairs), best accuracy over learning
    rates; then a line saying in which columns D and G are ahead of L (:func:`delta_rule_ahead`)."""
    best = best_by_cell(results)
    mixers = list(dict.fromkeys(r["mixer"] for r in results))
    cols = sorted({(w, p) for _, w, p in best})
    head = "| mixer | " + " | ".join(f"d={w}, {p} kv" for w, p in cols) + " |"
    lines = [head, "|---|" + "---:|" * len(cols)]
    for m in mixers:
        cells = [f"{best[(m, w, p)]['accuracy']:.3f}" if (m, w, p) in best else "—" for w, p in cols]
        lines.append(f"| {MIXER_NAMES[m]} ({m}) | " + " | ".join(cells) + " |")
    ahead = delta_rule_ahead(results)
    if ahead:
        verdict = ", ".join(f"d={w}, {p} kv: {'yes' if ok else 'NO'}" for (w, p), ok in ahead.items())
        lines += ["", f"delta rule (D, G) ahead of linear attention (L): {verdict}"]
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
    grid = [(cfg, m, w, p, lr) for w in cfg.widths for p in cfg.num_pairs for m in cfg.mixers for lr in cfg.lrs]
    jobs = sorted(grid, key=lambda j: -run_cost(j[1], j[2], j[3]))  # longest first: the workers finish together
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
    order = {(m, w, p, lr): i for i, (_, m, w, p, lr) in enumerate(grid)}
    results.sort(key=lambda r: order[(r["mixer"], r["width"], r["num_pairs"], r["lr"])])
    Path(out, "results.json").write_text(json.dumps(results, indent=1))
    Path(out, "table.md").write_text(format_table(results) + "\n")
    plot(results, out / "mqar.png")
    return results
