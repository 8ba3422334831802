"""Small corpora and configs for fast training tests."""
from __future__ import annotations

from pathlib import Path

#: A 2-layer, width-32 model: a step takes milliseconds on the CPU.
SMALL_MODEL = {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 16, "intermediate_size": 64}


def write_corpus(root: Path, n_files: int = 12) -> Path:
    """A folder of small Python-like text files (some long, some shorter than a window)."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(3 + 7 * (i % 4)))
        (root / f"mod{i:02d}.py").write_text(body)
    return root


def small_config(out: Path, data: Path, **kw):
    """A TrainConfig for a few fast steps."""
    from gdn.train import TrainConfig

    base = dict(data=str(data), out=str(out), model=dict(SMALL_MODEL), seq_len=32, batch_size=4, steps=6,
                warmup_steps=2, lr=3e-3, log_every=1, eval_every=3, eval_batches=2, save_every=3, keep_last=5,
                tensorboard=False, progress=False, val_fraction=0.25)
    base.update(kw)
    return TrainConfig(**base)
