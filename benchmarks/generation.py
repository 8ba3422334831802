"""Generation benchmark: time to first token and decode speed of ``model.generate()``, side by side.

Every model runs the same calls in one process: random weights, random prompts of ``--prompts``
tokens at each batch size of ``--batches``, greedy, ``--new-tokens`` new tokens, no eos (every row
runs to the end). Models (``--models``, in this order):

- ``gdn-graph``: gdn's ``gdn`` preset (all Gated DeltaNet) with ``cache_implementation="static"``:
  prefill on the chunked forward, every later token one replayed CUDA graph (gdn.models.graph_generate).
- ``gdn-eager``: the same model through transformers' own decoding loop on the eager GDNCache.
- ``transformer-graph``: gdn's ``transformer`` preset (all global softmax attention) on the graph decoder.
- ``llama``: transformers' ``LlamaForCausalLM`` with the transformer preset's shape (about 374M at
  340m) and ``cache_implementation="static"``, which transformers' ``generate`` decodes with
  ``torch.compile`` (mode ``reduce-overhead``) on CUDA: the fast path transformers itself offers.
- ``fla``: FLA's ``GatedDeltaNetForCausalLM`` built to the gdn preset's shape (its own cache and
  kernels; skipped with the reason when ``fla`` does not import or the device is not CUDA). Last,
  so that a failure of a foreign kernel cannot spoil the other rows' CUDA context.

Per row: TTFT (from the ``generate`` call to the first token's logits, the prompt's prefill
included), new tokens/s over the decode steps after the first token (batch × steps / time), and
the peak of allocated GPU memory during the call (weights included). The times come from a logits
processor that records a CUDA event at every step, so nothing extra synchronises the loop. Before
each timed call the same call runs once with a few tokens (CUDA graph capture, ``torch.compile``,
Triton autotuning at that shape). Static caches (gdn graph, Llama) are sized to prompt + new tokens.

Skipped with a printed note: batch × prompt above ``--max-prefill-tokens`` (one prefill pass of
that many tokens), and for attention models a KV cache above ``--kv-budget-gib`` (the gdn graph path
holds its prefill cache and the static copy at once, so it counts twice), and every row once
``--max-seconds`` have passed (so the order above is also the priority). Each row prints when done;
``--json`` rewrites a file after every row; the table prints at the end, also after SIGTERM.

    python benchmarks/generation.py                         # H200: 340m, batches 1/32/256, prompts 2k/32k (~5 min)
    python benchmarks/generation.py --quick                 # batches 1/32, prompt 2k, 32 new tokens
    python benchmarks/generation.py --size tiny --device cpu   # CPU smoke run (batches 1/4, prompts 64/256)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from dataclasses import dataclass

# FLA's GatedDeltaNet kernels stay on FLA's own Triton path (its FlashQLA / TileLang routes are
# measured by benchmarks/ops_gpu.py); set before fla is first imported.
os.environ.setdefault("FLA_FLASH_QLA", "0")
os.environ.setdefault("FLA_TILELANG", "0")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LogitsProcessor  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn.checkpoint import atomic_write_text  # noqa: E402
from gdn.models import GDNConfig, GDNForCausalLM  # noqa: E402

MODELS = ("gdn-graph", "gdn-eager", "transformer-graph", "llama", "fla")
GIB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--size", default="340m", help="model size: tiny, 125m, 340m, 1.3b")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,32,256; CPU 1,4)")
    p.add_argument("--prompts", "--contexts", default=None,
                   help="comma-separated prompt lengths (default 2048,32768; CPU 64,256)")
    p.add_argument("--new-tokens", "--decode-tokens", type=int, default=None,
                   help="new tokens per call (default 64; CPU 8)")
    p.add_argument("--quick", action="store_true", help="batches 1,32, prompt 2048, 32 new tokens (unless given)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--dtype", default="auto", help="bfloat16, float16, float32 or auto (bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--max-prefill-tokens", type=int, default=2**20,
                   help="skip a batch × prompt above this many tokens (default 1,048,576)")
    p.add_argument("--kv-budget-gib", type=float, default=64.0,
                   help="skip an attention model's row whose KV cache would exceed this (default 64)")
    p.add_argument("--max-seconds", type=float, default=540.0,
                   help="start no new row after this many seconds (its rows get a note; 0: no limit; default 540)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON (after every row)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    args = p.parse_args(argv)
    args.models = [s.strip() for s in args.models.split(",") if s.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad or not args.models:
        p.error(f"--models: unknown {bad}; choose from {', '.join(MODELS)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = args.device == "cpu"
    if args.batches is None:
        args.batches = "1,4" if cpu else "1,32" if args.quick else "1,32,256"
    if args.prompts is None:
        args.prompts = "64,256" if cpu else "2048" if args.quick else "2048,32768"
    if args.new_tokens is None:
        args.new_tokens = 8 if cpu else 32 if args.quick else 64
    try:
        args.batches = [int(s) for s in args.batches.split(",") if s]
        args.prompts = [int(s) for s in args.prompts.split(",") if s]
    except ValueError:
        p.error("--batches and --prompts take comma-separated integers")
    if not args.batches or min(args.batches) < 1 or not args.prompts or min(args.prompts) < 1:
        p.error("--batches and --prompts must be positive integers")
    if args.new_tokens < 2:
        p.error(f"--new-tokens must be at least 2 (a decode step after the first token), got {args.new_tokens}")
    if args.dtype == "auto":
        args.dtype = "float32" if cpu else "bfloat16"
    if args.dtype not in ("bfloat16", "float16", "float32"):
        p.error(f"--dtype must be bfloat16, float16, float32 or auto, got {args.dtype!r}")
    args.dtype = getattr(torch, args.dtype)
    return args


class Clock(LogitsProcessor):
    """A logits processor that leaves the scores alone and notes when each step's logits are ready:
    a CUDA event per call on a GPU (no synchronisation), the host clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.start = self._mark()

    def _mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def __call__(self, input_ids, scores):
        self.marks.append(self._mark())
        return scores

    def seconds(self) -> list[float]:
        """Seconds from the start to every step's mark."""
        if self.cuda:
            torch.cuda.synchronize()
            return [self.start.elapsed_time(m) / 1e3 for m in self.marks]
        return [m - self.start for m in self.marks]


@dataclass
class Model:
    """A model under test: how to call ``generate`` on it and what its cache costs."""
    name: str
    module: torch.nn.Module
    static: bool             # cache_implementation="static" (a static cache sized per call)
    kv_bytes_per_token: int  # per sequence, over all attention layers (0: none)
    kv_copies: int = 1       # KV caches alive at once at the peak


def _kv_per_token(cfg, letters: str, dtype: torch.dtype) -> int:
    """KV bytes per token and sequence of the global attention layers of a gdn config."""
    head_dim = cfg.attention_head_dim or cfg.hidden_size // cfg.num_attention_heads
    per_layer = 2 * cfg.num_key_value_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return per_layer * sum(cfg.layer_pattern.count(c) for c in letters)


def build(name: str, args, device: torch.device) -> Model:
    """Instantiate model ``name`` with random weights on ``device`` (raises with the reason when it cannot)."""
    torch.manual_seed(args.seed)
    preset = "transformer" if name in ("transformer-graph", "llama") else "gdn"
    cfg = GDNConfig.from_preset(preset, args.size)
    if name == "fla":
        if device.type != "cuda":
            raise RuntimeError("FLA's kernels need a CUDA device")
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
        fcfg = GatedDeltaNetConfig(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                                   num_heads=cfg.num_heads, num_v_heads=cfg.num_v_heads, head_dim=cfg.head_dim,
                                   expand_v=cfg.expand_v, conv_size=cfg.conv_size, intermediate_size=cfg.intermediate_size,
                                   vocab_size=cfg.vocab_size, norm_eps=cfg.norm_eps, tie_word_embeddings=False,
                                   fuse_cross_entropy=False)
        with torch.device(device):
            module = GatedDeltaNetForCausalLM(fcfg)
        model = Model(name, module, static=False, kv_bytes_per_token=0)
    elif name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        lcfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                           intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                           num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                           max_position_embeddings=max(args.prompts) + args.new_tokens, rms_norm_eps=cfg.norm_eps,
                           tie_word_embeddings=False)
        with torch.device(device):
            module = LlamaForCausalLM(lcfg)
        model = Model(name, module, static=True, kv_bytes_per_token=_kv_per_token(cfg, "A", args.dtype))
    else:
        with torch.device(device):
            module = GDNForCausalLM(cfg)
        graph = name.endswith("-graph")
        model = Model(name, module, static=graph, kv_bytes_per_token=_kv_per_token(cfg, "A", args.dtype),
                      kv_copies=2 if graph else 1)
    model.module = model.module.to(args.dtype).eval()
    gc_ = model.module.generation_config
    gc_.eos_token_id, gc_.pad_token_id, gc_.do_sample = None, 0, False  # every row runs to the end
    return model


def skip_reason(model: Model, B: int, T: int, args) -> str | None:
    if B * T > args.max_prefill_tokens:
        return f"prefill of {B}×{T:,} = {B * T:,} tokens is above --max-prefill-tokens {args.max_prefill_tokens:,}"
    kv = model.kv_bytes_per_token * B * (T + args.new_tokens) * model.kv_copies
    if kv > args.kv_budget_gib * GIB:
        copies = " (prefill cache + static copy)" if model.kv_copies > 1 else ""
        return f"KV cache {kv / GIB:,.1f} GiB{copies} is above --kv-budget-gib {args.kv_budget_gib:g}"
    return None


def _generate(model: Model, ids: torch.Tensor, new: int, max_cache: int, processors=None):
    kw = dict(max_new_tokens=new, do_sample=False)
    if model.static:
        kw.update(cache_implementation="static", max_cache_len=max_cache)
    if processors is not None:
        kw["logits_processor"] = processors
    return model.module.generate(ids, attention_mask=torch.ones_like(ids), **kw)


@torch.no_grad()
def measure(model: Model, B: int, T: int, args, device: torch.device) -> dict:
    """Warm-up call, then the timed call: TTFT, new tokens/s, peak GiB."""
    gen = torch.Generator().manual_seed(args.seed + B * 7 + T)
    vocab = model.module.config.vocab_size
    ids = torch.randint(1, vocab, (B, T), generator=gen).to(device)
    max_cache = T + args.new_tokens
    _generate(model, ids, min(4, args.new_tokens), max_cache)  # graphs, compilation, autotuning
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    clock = Clock(device)
    out = _generate(model, ids, args.new_tokens, max_cache, [clock])
    marks = clock.seconds()
    steps = len(marks) - 1
    if out.shape[1] != T + args.new_tokens or steps != args.new_tokens - 1:
        raise RuntimeError(f"expected {args.new_tokens} new tokens, got {out.shape[1] - T} ({len(marks)} steps timed)")
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return dict(ttft_ms=marks[0] * 1e3, new_tok_s=B * steps / (marks[-1] - marks[0]), peak_gib=peak)


def _fmt(row: dict) -> str:
    if row.get("note"):
        return f"| {row['model']} | {row['batch']} | {row['prompt']:,} | – | – | – | {row['note']} |"
    peak = "n/a" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"
    return (f"| {row['model']} | {row['batch']} | {row['prompt']:,} | {row['ttft_ms']:,.1f} | "
            f"{row['new_tok_s']:,.0f} | {peak} | |")


def table(rows: list[dict], args, device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    dt = str(args.dtype).replace("torch.", "")
    head = (f"### model.generate, size {args.size}, {dt}, greedy, {args.new_tokens} new tokens, {name}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}\n\n"
            "| model | batch | prompt | TTFT ms | new tok/s | peak GiB | note |\n|---|---|---|---|---|---|---|")
    return "\n".join([head] + [_fmt(r) for r in rows])


def write_json(path: str | None, rows: list[dict], args, device: torch.device) -> None:
    if path is None:
        return
    meta = dict(size=args.size, dtype=str(args.dtype), new_tokens=args.new_tokens, batches=args.batches,
                prompts=args.prompts, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                torch=torch.__version__, transformers=transformers.__version__, argv=sys.argv[1:])
    atomic_write_text(path, json.dumps({"meta": meta, "rows": rows}, indent=1))


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    rows: list[dict] = []
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    def add(row: dict) -> None:
        rows.append(row)
        log(_fmt(row))
        write_json(args.json, rows, args, device)

    try:
        for name in args.models:
            combos = [(B, T) for B in args.batches for T in args.prompts]
            if args.max_seconds and time.perf_counter() - t0 > args.max_seconds:
                for B, T in combos:
                    add(dict(model=name, batch=B, prompt=T, note=f"not run: --max-seconds {args.max_seconds:g} spent"))
                continue
            try:
                model = build(name, args, device)
            except Exception as e:  # a peer that cannot be built: its rows say why
                reason = f"not run: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log(f"{name}: {reason}")
                for B, T in combos:
                    add(dict(model=name, batch=B, prompt=T, note=reason))
                continue
            params = sum(p.numel() for p in model.module.parameters())
            log(f"{name}: {params / 1e6:,.1f}M parameters")
            for B, T in combos:
                row = dict(model=name, batch=B, prompt=T)
                why = skip_reason(model, B, T, args)
                if why is None and args.max_seconds and time.perf_counter() - t0 > args.max_seconds:
                    why = f"not run: --max-seconds {args.max_seconds:g} spent"
                if why is None:
                    try:
                        row.update(measure(model, B, T, args, device))
                    except torch.cuda.OutOfMemoryError:
                        why = "out of memory"
                    except Exception as e:
                        why = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if why is not None:
                    row["note"] = why
                add(row)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        print("\n" + table(rows, args, device), flush=True)
        print("\nTTFT: generate call to the first token's logits (prefill included); new tok/s: batch × decode "
              "steps after the first token / their time; peak: max allocated GPU memory in the timed call.",
              flush=True)
        write_json(args.json, rows, args, device)
    return rows


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still prints what was measured
    main()
