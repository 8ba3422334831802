"""Check: one pass of the delta rule against linear attention as an associative memory, no training.

``pairs`` key-value pairs are written into a ``dim x dim`` state, keys drawn from ``key_ids`` fixed
random vectors (SiLU then L2 norm, as the gdn mixers make their keys), values from 64 fixed random
unit vectors; every key is then read once and counts as recalled when its read-out is nearest (dot
product) to its own value among the 64. Linear attention writes ``S += v kᵀ``; the delta rule writes
``S += β (v − S k) kᵀ`` in the order of the pairs; least squares solves ``S K = V`` for the pairs at
once (exact when ``pairs <= dim``). Prints a markdown table, one row per (head size, pairs). The
figures behind docs/TRAINING.md's "MQAR" remark that one pass of the delta rule is not a
least-squares write:

    python benchmarks/mqar_memory.py --dim 16 32 --pairs 16 32
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def recall(dim: int, pairs: int, key_ids: int, betas: list[float], trials: int, seed: int) -> dict:
    """Share of keys recalled, per writer: ``{"linear": a, "delta b": a, ..., "least squares": a}``."""
    g = torch.Generator().manual_seed(seed)
    keys = F.normalize(F.silu(torch.randn(key_ids, dim, generator=g)), dim=-1)
    values = F.normalize(torch.randn(64, dim, generator=g), dim=-1)
    hits = dict.fromkeys(["linear", *[f"delta {b:g}" for b in betas], "least squares"], 0)
    for _ in range(trials):
        ki = torch.randperm(key_ids, generator=g)[:pairs]
        vi = torch.randint(0, len(values), (pairs,), generator=g)
        k, v = keys[ki], values[vi]
        states = {"linear": v.T @ k, "least squares": torch.linalg.lstsq(k, v).solution.T}
        for b in betas:
            s = torch.zeros(dim, dim)
            for t in range(pairs):
                s = s + b * torch.outer(v[t] - s @ k[t], k[t])
            states[f"delta {b:g}"] = s
        for name, s in states.items():
            hits[name] += int(((k @ s.T) @ values.T).argmax(-1).eq(vi).sum())
    return {name: h / (trials * pairs) for name, h in hits.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, nargs="+", default=[16, 32], help="key (and value) dimensions")
    p.add_argument("--pairs", type=int, nargs="+", default=[16, 32], help="pairs written per sequence")
    p.add_argument("--key-ids", type=int, default=255, help="distinct keys the pairs are drawn from")
    p.add_argument("--betas", type=float, nargs="+", default=[1.0, 0.5, 0.2], help="delta-rule write strengths")
    p.add_argument("--trials", type=int, default=300, help="sequences per cell")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    writers = ["linear", *[f"delta {b:g}" for b in a.betas], "least squares"]
    print(f"Share of keys recalled, {a.trials} sequences per cell, keys drawn from {a.key_ids} ids, seed {a.seed}\n")
    print("| head size | pairs | " + " | ".join(writers) + " |")
    print("|---|---|" + "---|" * len(writers))
    for dim in a.dim:
        for pairs in a.pairs:
            r = recall(dim, pairs, a.key_ids, a.betas, a.trials, a.seed)
            print(f"| {dim} | {pairs} | " + " | ".join(f"{r[w]:.3f}" for w in writers) + " |", flush=True)


if __name__ == "__main__":
    main()
