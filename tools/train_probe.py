"""Probe the first steps of a ``gdn train`` run: the first packed row's forward against each of its
documents run alone (they must agree: a packed row never mixes its documents), the parameters
whose gradient is not finite, then the loss and gradient norm of every step: where a run's loss
turns NaN, whether the packed forward, the backward or the optimisation (a learning rate too high
for the model) is the cause.

    python tools/train_probe.py [--preset gdn] [--size 340m] [--seq-len 4096] [--batch 4] [--steps 10]
                                [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn.train.config import build_config  # noqa: E402
from gdn.train.loop import Trainer  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gdn")
    ap.add_argument("--size", default="340m")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--docs", type=int, default=6, help="documents of the first row compared alone")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    out = tempfile.mkdtemp()
    sets = [f"seq_len={a.seq_len}", f"batch_size={a.batch}", "eval_every=100000", "save_every=100000", "progress=false"] + a.set
    cfg = build_config(None, dict(preset=a.preset, size=a.size, steps=a.steps, out=out), sets)
    t = Trainer(cfg)
    ids, cu = t.micro_batches()[0]
    lens = (cu[1:] - cu[:-1]).tolist()
    print(f"first row: {ids.shape[1]} tokens, {len(lens)} documents, longest {max(lens)}, shortest {min(lens)}")
    dev = t.device
    ids_d, cu_d = ids.to(dev), cu.to(dev)
    with torch.no_grad(), t.autocast():
        logits = t.model(input_ids=ids_d, cu_seqlens=cu_d).logits.float()
    with t.autocast():
        loss = t.model(input_ids=ids_d, labels=ids_d, cu_seqlens=cu_d).loss
    print(f"packed loss {loss.item():.4f}, logits finite {bool(torch.isfinite(logits).all())}")
    order = sorted(range(len(lens)), key=lambda i: -lens[i])[: a.docs]
    with torch.no_grad(), t.autocast():
        for i in order:
            s, e = int(cu[i]), int(cu[i + 1])
            alone = t.model(input_ids=ids_d[:, s:e]).logits.float()
            d = (alone - logits[:, s:e]).abs().max().item()
            print(f"  document {i} ({e - s} tokens): max |alone - packed| {d:.3e}, "
                  f"alone finite {bool(torch.isfinite(alone).all())}")
    loss.backward()
    bad = [n for n, p in t.model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    print(f"non-finite gradients: {len(bad)} parameters {bad[:8]}")
    t.optimizer.zero_grad(set_to_none=True)
    for _ in range(a.steps):
        loss, gnorm = t.train_step()
        print(f"step {t.step}: loss {loss:.4f}, grad norm {gnorm:.3e}", flush=True)


if __name__ == "__main__":
    main()
