"""Generation benchmark: prefill and decode throughput and per-sequence memory at several contexts.

For each preset (default: gdn, gdn-h1, transformer at size 340m) and context length, the prompt is
prefilled in one chunked pass (:func:`gdn.generation.prefill`), then ``--decode-tokens`` tokens are
decoded one at a time on the recurrent path. Prints two markdown tables: throughput and memory,
and the decoding state held per layer type (constant in the context for the recurrent mixers,
growing for global attention, bounded by the window for sliding-window attention). ``--check T``
(default 128) adds the relative error of prefill + token-by-token decode against one forward pass.

    python benchmarks/generation.py                                   # 340m, 2k/8k/32k, CUDA if present
    python benchmarks/generation.py --size tiny --contexts 256,1024   # a quick CPU run
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from gdn.generation import decode_step, prefill
from gdn.models import LAYER_TYPES, GDNConfig, GDNForCausalLM


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="340m", help="model size: tiny, 125m, 340m, 1.3b")
    p.add_argument("--presets", default="gdn,gdn-h1,transformer", help="comma-separated presets")
    p.add_argument("--contexts", default="2048,8192,32768", help="comma-separated prompt lengths")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded after the prefill (timed)")
    p.add_argument("--batch", type=int, default=1, help="sequences per batch")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--dtype", default="auto", help="bfloat16, float16, float32 or auto (bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--repeats", type=int, default=2, help="timed repetitions (the best is reported)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    p.add_argument("--check", type=int, default=128, metavar="T",
                   help="also report the relative error between prefill + token-by-token decode and one full "
                        "forward over T tokens (0: skip)")
    args = p.parse_args(argv)
    args.presets = [s for s in args.presets.split(",") if s]
    args.contexts = [int(s) for s in args.contexts.split(",") if s]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.dtype = getattr(torch, args.dtype)
    if args.decode_tokens < 1 or args.batch < 1 or args.repeats < 1:
        p.error("--decode-tokens, --batch and --repeats must be positive")
    return args


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.3f}"


def run_one(model, ctx, args, device):
    """Best-of-repeats prefill/decode timings and memory for one context."""
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, ctx), generator=gen).to(device)
    best = None
    for _ in range(args.repeats):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        _sync(device)
        t0 = time.perf_counter()
        logits, cache = prefill(model, ids)
        _sync(device)
        t_prefill = time.perf_counter() - t0
        tok = logits.argmax(-1)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(args.decode_tokens):
            tok = decode_step(model, tok, cache).argmax(-1)
        _sync(device)
        t_decode = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
        res = dict(prefill=args.batch * ctx / t_prefill, decode=args.batch * args.decode_tokens / t_decode,
                   state=cache.nbytes() / args.batch, peak=None if peak is None else peak / args.batch,
                   layers=[n / args.batch for n in cache.layer_nbytes()])
        if best is None or res["prefill"] + res["decode"] > best["prefill"] + best["decode"]:
            best = res
        del cache, logits
    return best


@torch.no_grad()
def decode_error(model, T: int, device, seed: int) -> float:
    """Relative RMS error of the logits of prefill(T/2) + decode(T/2 tokens) against one forward pass
    over the same T tokens (positions T/2 − 1 .. T − 1)."""
    ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(seed)).to(device)
    full = model(ids, use_cache=False).logits[0, T // 2 - 1:].float()
    logits, cache = prefill(model, ids[:, :T // 2])
    steps = [logits[0]]  # the prediction at position T/2 - 1, then one per decoded token
    for t in range(T // 2, T):
        steps.append(decode_step(model, ids[:, t], cache)[0])
    got = torch.stack(steps)
    return ((got - full).norm() / full.norm()).item()


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    rows, state_rows, checks = [], [], []
    for preset in args.presets:
        torch.manual_seed(args.seed)
        cfg = GDNConfig.from_preset(preset, args.size)
        with torch.device(device):  # initialise on the device: much faster than on CPU for 340m+
            model = GDNForCausalLM(cfg)
        model = model.to(dtype=args.dtype).eval()
        params = sum(p.numel() for p in model.parameters())
        warm = torch.randint(0, cfg.vocab_size, (args.batch, min(256, min(args.contexts))), device=device)
        _, c = prefill(model, warm)  # compile / autotune kernels outside the timings
        decode_step(model, warm[:, -1], c)
        err = decode_error(model, args.check, device, args.seed) if args.check else None
        per_letter: dict[str, list] = {}
        for ctx in args.contexts:
            r = run_one(model, ctx, args, device)
            peak = "n/a" if r["peak"] is None else _mib(r["peak"])
            rows.append(f"| {preset} | {params / 1e6:,.1f}M | {ctx:,} | {r['prefill']:,.0f} | {r['decode']:,.1f} | "
                        f"{_mib(r['state'])} | {peak} |")
            for letter in dict.fromkeys(cfg.layer_pattern):
                i = cfg.layer_pattern.index(letter)
                per_letter.setdefault(letter, []).append(r["layers"][i])
        for letter, sizes in per_letter.items():
            state_rows.append(f"| {preset} | {letter} ({LAYER_TYPES[letter]}) | "
                              + " | ".join(_mib(s) for s in sizes) + " |")
        if err is not None:
            checks.append(f"| {preset} | {args.check} | {err:.2e} |")
        del model
    dt = str(args.dtype).replace("torch.", "")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"### Generation, size {args.size}, {dt}, batch {args.batch}, {args.decode_tokens} decode tokens, {name}\n")
    print("| preset | params | context | prefill tok/s | decode tok/s | state MiB/seq | peak MiB/seq |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n### Decoding state per layer and sequence (MiB) after the prompt\n")
    print("| preset | layer | " + " | ".join(f"{c:,}" for c in args.contexts) + " |")
    print("|---|---|" + "---|" * len(args.contexts))
    print("\n".join(state_rows))
    if checks:
        print("\n### Prefill + decode against one forward pass (logits, relative RMS error)\n")
        print("| preset | tokens | rel. error |")
        print("|---|---|---|")
        print("\n".join(checks))
    print("\nstate = conv tails + fp32 recurrent state (G/D/M/L) or keys/values (A, S); "
          "peak = CUDA peak allocation above the weights during prefill + decode.")


if __name__ == "__main__":
    main()
