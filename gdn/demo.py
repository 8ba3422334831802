"""`make demo`: train the default tiny Gated DeltaNet on this Python's standard library for a few
minutes, report validation bits per byte against the unigram baseline, write the loss curve and
print a sample. ``op_table`` / ``print_op_table`` (``gdn bench``) run the same
random input through every backend of every op and report agreement and time."""
from __future__ import annotations

import logging
import os
import shutil
import time

import torch

from . import ops

#: Seconds of training the demo aims for (its steps are sized from a timed step on this machine).
TRAIN_SECONDS = float(os.environ.get("GDN_DEMO_SECONDS", "270"))


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
    """Rows (op, backend, rel. error vs naive, ms) for every op and backend on ``device``
    (B=1, T, H=4, K=V=64, fp32)."""
    q, k, v, g, beta = _inputs(T=T, device=device)
    gk = g[..., None] * torch.linspace(0.5, 1.5, q.shape[-1], device=device)  # a per-channel decay for KDA
    calls = {
        "linear_attention": lambda b: ops.linear_attention(q, k, v, backend=b)[0],
        "gated_linear_attention": lambda b: ops.gated_linear_attention(q, k, v, g, backend=b)[0],
        "delta_rule": lambda b: ops.delta_rule(q, k, v, beta, backend=b)[0],
        "gated_delta_rule": lambda b: ops.gated_delta_rule(q, k, v, g, beta, backend=b)[0],
        "kimi_delta_attention": lambda b: ops.kimi_delta_attention(q, k, v, gk, beta, backend=b)[0],
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


def print_op_table(T: int = 512) -> None:
    """Print :func:`op_table` on the default device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"gdn ops on {device}: B=1, T={T}, H=4, K=V=64, fp32 (error: relative RMS vs the naive recurrence)")
    print(f"{'op':<24}{'backend':<9}{'rel. error':>12}{'time ms':>10}")
    for name, b, err, ms in op_table(device, T):
        print(f"{name:<24}{b:<9}{err:>12.2e}{ms:>10.2f}")


def _step_seconds(trainer, reps: int = 3) -> float:
    """Median time of forward + backward of one training batch (gradients discarded), plus 15 %."""
    ids, cu = trainer.windows.pack(range(trainer.cfg.batch_size))
    trainer.model(input_ids=ids, labels=ids, cu_seqlens=cu).loss.backward()  # warm-up (first-touch memory)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        trainer.model(input_ids=ids, labels=ids, cu_seqlens=cu).loss.backward()
        times.append(time.perf_counter() - t)
    trainer.model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2] * 1.15  # optimizer step and bookkeeping


def main(out: str = "runs/demo") -> int:
    """Train, evaluate, plot, sample; prints a short report. Returns 0."""
    from .data import stdlib_root
    from .generation import generate
    from .train import TrainConfig, Trainer

    logging.basicConfig(level=logging.WARNING)
    start = time.time()
    shutil.rmtree(out, ignore_errors=True)  # the demo's own folder: a fresh run every time
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cfg = TrainConfig(out=out, seq_len=256, batch_size=8, lr=3e-3, warmup_steps=30, min_lr_ratio=0.05,
                      weight_decay=0.1, steps=1000, eval_every=100, eval_batches=4, save_every=10**6,
                      log_every=5, keep_last=1, tensorboard=False, time_limit=TRAIN_SECONDS * 1.3)
    trainer = Trainer(cfg)
    tr, va = trainer.train_data, trainer.val_data
    print(f"data: {stdlib_root()} *.py -> {len(tr) / 1e6:.1f} MB train, {len(va) / 1e6:.2f} MB held out "
          "(fixed split by path hash); byte-level tokens")
    n_params = sum(p.numel() for p in trainer.model.parameters())
    per_step = _step_seconds(trainer)
    cfg.steps = int(max(300, min(1500, TRAIN_SECONDS / per_step)))
    cfg.eval_every = max(1, cfg.steps // 8)
    print(f"model: preset {cfg.preset}, size {cfg.size} ({n_params / 1e6:.2f}M parameters, layers "
          f"{trainer.model_config.layer_pattern}); {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} bytes "
          f"(~{per_step:.2f} s/step on {torch.get_num_threads()} threads)")
    res = trainer.run()
    print(f"\nvalidation: {res.val_bpb:.3f} bits/byte (loss {res.val_loss:.3f} nats/byte) after {res.step} steps; "
          f"unigram baseline {res.unigram_bpb:.3f} bits/byte ({res.unigram_bpb - res.val_bpb:.2f} bits/byte better)")
    print(f"loss curve: {res.out / 'loss_curve.png'}; checkpoint: {res.checkpoint}")
    prompt = "import os\n\n\ndef "
    ids = torch.tensor([trainer.tokenizer.encode(prompt)])
    gen = torch.Generator().manual_seed(0)
    outp = generate(trainer.model, ids, max_new_tokens=300, temperature=0.9, top_p=0.95, generator=gen)
    print("\nsample (temperature 0.9, top-p 0.95, prefill + recurrent decode):\n" + "-" * 60)
    print(trainer.tokenizer.decode(outp[0].tolist()))
    print("-" * 60 + f"\ndemo finished in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
