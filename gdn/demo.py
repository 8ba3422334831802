"""`make demo`: the same random input through every backend of every op; agreement and time."""
from __future__ import annotations

import time

import torch

from . import ops


def _inputs(B=1, T=512, H=4, K=64, V=64, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=dtype).to(device)

    q, k, v = r(B, T, H, K), torch.nn.functional.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    g = -torch.nn.functional.softplus(r(B, T, H)) * 0.1
    beta = torch.sigmoid(r(B, T, H))
    return q, k, v, g, beta


def _time(fn, reps=3):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def op_table(device="cpu", T=512):
    """Rows (op, backend, rel. error vs naive, ms) for every op and backend on ``device``."""
    q, k, v, g, beta = _inputs(T=T, device=device)
    calls = {
        "linear_attention": lambda b: ops.linear_attention(q, k, v, backend=b)[0],
        "gated_linear_attention": lambda b: ops.gated_linear_attention(q, k, v, g, backend=b)[0],
        "delta_rule": lambda b: ops.delta_rule(q, k, v, beta, backend=b)[0],
        "gated_delta_rule": lambda b: ops.gated_delta_rule(q, k, v, g, beta, backend=b)[0],
        "softmax_attention": lambda b: ops.softmax_attention(q, k, v, backend=None if b == "chunk" else b),
    }
    rows = []
    for name, call in calls.items():
        ref = call("naive")
        backends = [b for b in ops.available_backends(device) if not (name == "softmax_attention" and b == "triton")]
        for b in backends:
            out = call(b)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            label = "sdpa" if name == "softmax_attention" and b == "chunk" else b
            rows.append((name, label, err, _time(lambda: call(b))))
    return rows


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T = 512
    print(f"gdn ops on {device}: B=1, T={T}, H=4, K=V=64, fp32 (error: relative RMS vs the naive recurrence)")
    print(f"{'op':<24}{'backend':<9}{'rel. error':>12}{'time ms':>10}")
    for name, b, err, ms in op_table(device, T):
        print(f"{name:<24}{b:<9}{err:>12.2e}{ms:>10.2f}")


if __name__ == "__main__":
    main()
