"""Probe: how the initial write strength β and the decay initialisation set the pace of MQAR learning.

Trains one 2-layer model (letter L, M, D, G or A) on MQAR at a constant learning rate (no warmup)
and prints query accuracy on 512 held-out sequences every ``--every`` steps, then a markdown table
of them. ``--beta-offset`` is added to the β pre-activation of D/G layers (``GDNConfig.beta_offset``:
β starts near sigmoid(offset); 0 is the published layer, β ≈ 0.5; a large offset such as 10 is β ≈ 1);
``--decay-init A_min A_max dt_min dt_max`` draws the M/G decay gates from those ranges (default: the
layers' own, A ∈ U(0.01, 16), dt log-uniform in [1e-3, 0.1]); ``--train-pairs 4 8 16`` trains on a
mixture of pair counts (``gdn.data.mqar.mqar_mixture``) and still tests on ``--pairs``; ``--heads``
sets the heads of every mixer. This is the diagnostic behind the ``gdn mqar`` presets' recipe
(docs/TRAINING.md), not part of the suite:

    OMP_NUM_THREADS=1 python benchmarks/mqar_beta.py G --beta-offset -3 --decay-init 0.01 1 1e-3 1e-2
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from gdn.data import mqar_batch
from gdn.data.mqar import mqar_mixture
from gdn.models import param_groups
from gdn.train.mqar import MQARConfig, accuracy, build_model


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("letter", choices=list("LMDGA"), help="mixer letter")
    p.add_argument("--beta-offset", type=float, default=0.0, help="added to the β pre-activation of D/G layers")
    p.add_argument("--decay-init", type=float, nargs=4, metavar=("A_MIN", "A_MAX", "DT_MIN", "DT_MAX"),
                   help="ranges of the M/G decay gates' initialisation")
    p.add_argument("--width", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=2, help="heads of every mixer (head size = width / heads)")
    p.add_argument("--pairs", type=int, default=8, help="key-value pairs of the test sequences")
    p.add_argument("--train-pairs", type=int, nargs="+", help="pair counts of the training mixture (default: --pairs)")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (constant)")
    p.add_argument("--seq-len", type=int, default=64, help="sequence length")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    p.add_argument("--steps", type=int, default=400, help="training steps")
    p.add_argument("--batch", type=int, default=64, help="sequences per step (each sequence is seen once)")
    p.add_argument("--every", type=int, default=100, help="steps between accuracy reports")
    p.add_argument("--seed", type=int, default=0, help="model and data seed")
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = MQARConfig(seq_len=a.seq_len, vocab_size=a.vocab, widths=[a.width], num_pairs=[a.pairs], num_heads=a.heads,
                     beta_offset=a.beta_offset, decay_init=a.decay_init, seed=a.seed)
    x, y = mqar_mixture(a.steps * a.batch, a.seq_len, a.train_pairs or [a.pairs], a.vocab, seed=a.seed)
    xt, yt = mqar_batch(512, a.seq_len, a.pairs, a.vocab, seed=a.seed * 1000 + a.pairs + 10**6)
    torch.manual_seed(a.seed)
    m = build_model(a.letter, a.width, cfg)
    opt = torch.optim.AdamW(param_groups(m, 0.1), lr=a.lr, betas=(0.9, 0.98))
    t0 = time.time()
    rows = []
    for s in range(a.steps):
        idx = slice(s * a.batch, (s + 1) * a.batch)
        logits = m(input_ids=x[idx], use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), y[idx].reshape(-1), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if (s + 1) % a.every == 0 or s + 1 == a.steps:
            rows.append((s + 1, loss.item(), accuracy(m, xt, yt), time.time() - t0))
            print(f"{a.letter} beta_offset={a.beta_offset:g} decay_init={a.decay_init} step {rows[-1][0]}: "
                  f"loss {rows[-1][1]:.3f}, accuracy {rows[-1][2]:.3f} ({rows[-1][3]:.0f} s)", flush=True)
    print(f"\n{a.letter}, width {a.width}, {a.heads} heads, {a.pairs} pairs, sequence {a.seq_len}, vocabulary "
          f"{a.vocab}, lr {a.lr:g}, beta_offset {a.beta_offset:g}, decay_init {a.decay_init}, seed {a.seed}\n")
    print("| step | loss | accuracy | s |\n|---|---|---|---|")
    for step, loss_v, acc, secs in rows:
        print(f"| {step} | {loss_v:.3f} | {acc:.3f} | {secs:.0f} |")


if __name__ == "__main__":
    main()
