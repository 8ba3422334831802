"""Training throughput: tokens/s and model-FLOPs utilisation of a gdn preset, and (on CUDA, when
``fla`` is importable) flash-linear-attention's ``GatedDeltaNetForCausalLM`` at the same config
and batch, side by side.

One step = forward + backward + AdamW step on ``[batch, seq_len]`` random ids (AdamW's fused form
on CUDA for both models, as ``gdn train`` steps it; ``--optimizer foreach`` for torch's default
multi-tensor form), bf16 autocast on CUDA (fp32 on CPU). Timed two ways after ``--warmup`` steps:
``--steps`` steps back to back, as a training loop runs them (the host launching the next step
while the GPU runs this one; the loss read once a step before the update, as ``gdn train``'s
non-finite check reads it): the step ms and tokens/s; and the median of as many steps each started
and ended on an idle GPU (a synchronisation on each side): what a step costs when none of the
host's time hides behind the GPU's. Model FLOPs per token:
6 x (matmul parameters) for the projections, plus 3 x the forward FLOPs of the token mixers
(chunkwise delta rule: per value head ``2·(2·C·K + 2·C·V + 3·K·V)`` with chunk C = 64; causal
softmax attention: ``2·T·d`` per head). MFU = achieved / ``--peak-tflops`` (default: 989 for an
H200's dense bf16; none on CPU). FLA is timed on its Triton path: ``FLA_FLASH_QLA=0`` and
``FLA_TILELANG=0`` are set (unless already set) before it is imported, so an installed FlashQLA or
TileLang does not change which kernels its column measures.

    python benchmarks/train.py --preset gdn --size 340m --seq-len 4096 --batch 8   # the H200 target
    python benchmarks/train.py --size tiny --seq-len 512 --batch 4                  # a quick CPU run
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gdn.models import GDNConfig, GDNForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import trace_gaps  # noqa: E402  (tools/: the idle-gap analysis of the profiled step)

CHUNK = 64
os.environ.setdefault("FLA_FLASH_QLA", "0")
os.environ.setdefault("FLA_TILELANG", "0")


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gdn", help="gdn preset")
    p.add_argument("--size", default="340m" if cuda else "tiny", help="tiny, 125m, 340m, 1.3b")
    p.add_argument("--seq-len", type=int, default=4096 if cuda else 512, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8 if cuda else 4, help="sequences per step")
    p.add_argument("--steps", type=int, default=10 if cuda else 3, help="timed steps")
    p.add_argument("--warmup", type=int, default=3 if cuda else 1, help="untimed steps first")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--compile", action="store_true", help="torch.compile the gdn model")
    p.add_argument("--compile-mode", default="default",
                   choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                   help="torch.compile's mode with --compile (reduce-overhead replays the compiled "
                        "forward and backward as CUDA graphs: no per-kernel host work per step)")
    p.add_argument("--peak-tflops", type=float, default=989.0 if cuda else 0.0, help="for MFU (0 = not reported)")
    p.add_argument("--no-fla", action="store_true", help="skip the FLA comparison")
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                   help="AdamW's form for both models: fused (one kernel a parameter group, CUDA only) or foreach")
    p.add_argument("--cuda-graph", action="store_true",
                   help="each model's whole step (forward, backward, fused AdamW) captured once in a CUDA graph and "
                        "replayed (gdn.train.graphs.GraphedStep): no host work between the step's kernels; a model "
                        "whose step cannot be captured is timed eagerly, and says so")
    p.add_argument("--profile", action="store_true",
                   help="per-kernel GPU times of one step of each model and where its GPU idles (CUDA)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="with --profile: keep each model's profiled step as a Chrome trace DIR/<model>.json.gz")
    p.add_argument("--config", default=None, metavar="JSON",
                   help="launch settings of gdn's kernels to use instead of the defaults: a JSON file or inline "
                        "JSON, e.g. '{\"other.swiglu\": {\"num_warps\": 4}}' (gdn.ops.tuning.update)")
    a = p.parse_args(argv)
    if a.cuda_graph and not cuda:
        p.error("--cuda-graph needs a CUDA device")
    if a.cuda_graph and (a.compile or a.optimizer != "fused"):
        p.error("--cuda-graph captures the eager model with the fused AdamW: not with --compile or --optimizer foreach")
    from gdn.ops.tuning import apply_config

    apply_config(p, a.config)
    return a


def model_flops_per_token(cfg: GDNConfig, T: int) -> float:
    """Training FLOPs per token (see the module docstring)."""
    D, n_layers = cfg.hidden_size, cfg.num_hidden_layers
    mlp = 3 * D * cfg.intermediate_size
    K, V = cfg.head_dim, int(cfg.head_dim * cfg.expand_v)
    H, HV = cfg.num_heads, cfg.num_v_heads
    rec_proj = D * (2 * H * K + HV * V) + 2 * D * HV + HV * V * D + (D * HV * V if cfg.use_gate else 0)
    ad = cfg.resolved_attention_head_dim
    att_proj = D * ad * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    matmul = cfg.vocab_size * D  # lm head
    mixer_fwd = 0.0
    for letter in cfg.layer_pattern:
        if letter in "GDML":
            matmul += rec_proj + mlp
            mixer_fwd += HV * 2 * (2 * CHUNK * K + 2 * CHUNK * V + 3 * K * V)
        else:
            matmul += att_proj + mlp
            span = T if letter == "A" else min(T, cfg.window_size or T)
            mixer_fwd += cfg.num_attention_heads * 2 * span * ad  # QK^T + PV, causal half of 2·2·span·d
    return 6 * matmul + 3 * mixer_fwd


def time_steps(model, B, T, vocab, steps, warmup, device, bf16, label="", profile=False, trace=None,
               optimizer="fused", graph=False, **fwd_kw):
    """(ms a step back to back, median ms of a step from an idle GPU, peak GiB) of ``steps`` steps
    after ``warmup``; with ``graph`` each step replayed from one CUDA graph (gdn.train.graphs.
    GraphedStep: two eager steps, then the capture, so at least three untimed steps)."""
    fused = optimizer == "fused" and device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused else {"foreach": True}))
    ids = torch.randint(0, vocab, (B, T), device=device)
    cuda = device.type == "cuda"
    if graph:
        from gdn.train.graphs import GraphedStep

        gs = GraphedStep(model, opt, loss_fn=lambda m, b: m(input_ids=b["ids"], labels=b["ids"], **fwd_kw).loss,
                         autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16), warmup=2)
        warmup = max(warmup, 3)

        def step(read_loss=False):
            loss, _ = gs({"ids": ids})
            if read_loss:
                float(loss)
    else:
        def step(read_loss=False):
            torch.compiler.cudagraph_mark_step_begin()  # a new step for compiled CUDA graphs (else nothing)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=ids, labels=ids, **fwd_kw).loss
            loss.backward()
            if read_loss:  # as gdn train reads the loss before each update (its non-finite check)
                float(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)

    times = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    # the same steps back to back, as a training loop runs them: the host launches the next step's
    # kernels while the GPU runs this one's, waiting only where the loop reads the loss
    t = time.perf_counter()
    for _ in range(steps):
        step(read_loss=True)
    if cuda:
        torch.cuda.synchronize()
    loop = (time.perf_counter() - t) / steps
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    if profile and cuda:
        kernel_profile(step, label, trace=trace)
    return loop, statistics.median(times), mem


#: kernel-name patterns of each part of a step, tried in order (lower-case substrings)
KINDS = (
    ("matrix products", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "wgmma", "matmul")),
    ("chunk op", ("fused_bwd", "fused_fwd", "fused_rev", "fused_rbwd", "kkt_solve", "warm_plan", "group_sum",
                  "state_", "chunk", "dqk", "wy_bwd", "dv_local", "wu_kernel", "output_kernel", "cumsum")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("glue kernels", ("rmsnorm", "norm_", "short_conv", "conv", "swiglu", "cross_entropy", "prologue", "l2norm")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("copies and fills", ("memcpy", "memset", "copy", "fill", "cat", "index")),
    ("other elementwise and reductions", ("elementwise", "reduce", "softmax", "embedding")),
)


def kind_of(name: str) -> str:
    """The part of a step a kernel belongs to, from its name (:data:`KINDS`), else "other"."""
    low = name.lower()
    return next((kind for kind, pats in KINDS if any(p in low for p in pats)), "other")


def by_kind(rows) -> list:
    """[(kind, ms, share)] of [(kernel name, ms)], largest first."""
    acc: dict = {}
    for name, ms in rows:
        k = kind_of(name)
        acc[k] = acc.get(k, 0.0) + ms
    total = sum(acc.values()) or 1.0
    return sorted(((k, ms, ms / total) for k, ms in acc.items()), key=lambda r: -r[1])


def kernel_profile(step, label, top=30, trace=None):
    """Print the GPU time per kernel of one training step (torch.profiler), largest first, the
    step's parts (matrix products, the chunk op, glue kernels, optimizer, ...) summed by kernel name,
    and where the GPU idles within the step (tools/trace_gaps.py: the gaps between kernels, charged
    to the host operator that launched the next one when the launch came after the GPU went idle).
    The host is traced too, which slows it: the idle figures are an upper bound of the unprofiled
    step's. ``trace``: a folder to keep the step's Chrome trace in, as ``<label>.json.gz``. Then
    PyTorch's own operators by input shapes with the GPU time of the kernels each launched itself
    (the casts, copies, adds and reductions between gdn's kernels and the products: which tensors
    they move)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in evs)
    print(f"\n{label}: GPU time of one step by kernel, ms (total {total / 1e3:.1f} ms)")
    for e in evs[:top]:
        print(f"  {e.device_time_total / 1e3:8.2f}  x{e.count:<4d} {e.key[:100]}")
    print(f"{label}: by part of the step, ms (share)")
    for kind, ms, share in by_kind([(e.key, e.device_time_total / 1e3) for e in evs]):
        print(f"  {ms:8.2f}  ({100 * share:4.1f} %)  {kind}")
    print(f"{label}: ATen operators by input shapes, GPU ms of the kernels each launched itself "
          "(matrix products left out)")
    cpu = torch.autograd.DeviceType.CPU
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_type == cpu and e.key.startswith("aten::") and e.self_device_time_total > 0
           and e.key not in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")]
    ops.sort(key=lambda e: -e.self_device_time_total)
    for e in ops[:top]:
        shapes = ", ".join(str(tuple(x)) for x in e.input_shapes if x)[:90]
        print(f"  {e.self_device_time_total / 1e3:8.2f}  x{e.count:<4d} {e.key[6:]:<24s} {shapes}")
    try:  # (the run's table comes after this: an unreadable trace must not lose it)
        with tempfile.TemporaryDirectory() as tmp:
            if trace:
                os.makedirs(trace, exist_ok=True)
            path = os.path.join(trace, f"{label}.json.gz") if trace else os.path.join(tmp, "step.json")
            prof.export_chrome_trace(path)  # (gzipped by torch for a .gz name)
            print(trace_gaps.report(trace_gaps.analyse(trace_gaps.load(path)), label))
    except (OSError, ValueError, KeyError) as e:
        print(f"{label}: idle analysis unavailable: {type(e).__name__}: {e}")


def fla_model(cfg: GDNConfig):
    """FLA's GatedDeltaNetForCausalLM at the same width, depth, heads and vocabulary (None if absent)."""
    try:
        import fla.ops.common.chunk_o as fla_chunk_o
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    except ImportError:
        return None
    fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # FLA refuses its gated backward on triton 3.6 / Hopper otherwise
    fcfg = GatedDeltaNetConfig(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                               num_heads=cfg.num_heads, head_dim=cfg.head_dim, expand_v=cfg.expand_v,
                               intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                               use_short_conv=cfg.use_short_conv, conv_size=cfg.conv_size, use_gate=cfg.use_gate,
                               norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_word_embeddings)
    return GatedDeltaNetForCausalLM(fcfg)


def main(argv=None):
    a = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = device.type == "cuda"
    cfg = GDNConfig.from_preset(a.preset, a.size)
    flops_tok = model_flops_per_token(cfg, a.seq_len)
    rows = []
    torch.manual_seed(0)
    model = GDNForCausalLM(cfg).to(device)
    if a.checkpointing:
        model.model.gradient_checkpointing = True
    run = torch.compile(model, mode=None if a.compile_mode == "default" else a.compile_mode) if a.compile else model
    s, idle, mem = time_steps(run, a.batch, a.seq_len, cfg.vocab_size, a.steps, a.warmup, device, bf16, "gdn",
                              a.profile, a.trace, a.optimizer, a.cuda_graph, use_cache=False)
    rows.append(("gdn", sum(p.numel() for p in model.parameters()), s, idle, mem))
    print(f"gdn: {s * 1e3:.1f} ms per step back to back ({idle * 1e3:.1f} from an idle GPU), "
          f"{a.batch * a.seq_len / s:,.0f} tokens/s, peak {mem:.1f} GiB", flush=True)
    del model, run
    if device.type == "cuda" and not a.no_fla:
        fm = fla_model(cfg)
        if fm is None:
            print("(fla not importable: no FLA comparison)")
        elif a.preset != "gdn":
            print("(FLA comparison only for the gdn preset)")
        else:
            fm = fm.to(device)
            if a.checkpointing:
                fm.gradient_checkpointing_enable()
            torch.cuda.reset_peak_memory_stats(device)
            try:
                s, idle, mem = time_steps(fm, a.batch, a.seq_len, cfg.vocab_size, a.steps, a.warmup, device, bf16,
                                          "fla", a.profile, a.trace, a.optimizer, a.cuda_graph)
            except RuntimeError as e:  # (a step that syncs with the host cannot be captured)
                if not a.cuda_graph:
                    raise
                print(f"(FLA's step could not be captured in a CUDA graph: {str(e).splitlines()[0][:200]}; "
                      "timed eagerly)", flush=True)
                torch.cuda.synchronize()
                s, idle, mem = time_steps(fm, a.batch, a.seq_len, cfg.vocab_size, a.steps, a.warmup, device, bf16,
                                          "fla", a.profile, a.trace, a.optimizer)
            rows.append(("fla", sum(p.numel() for p in fm.parameters()), s, idle, mem))
            print(f"fla: {s * 1e3:.1f} ms per step back to back ({idle * 1e3:.1f} from an idle GPU), "
                  f"{a.batch * a.seq_len / s:,.0f} tokens/s, peak {mem:.1f} GiB", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"training step (fwd+bwd+AdamW): preset {a.preset}, size {a.size}, batch {a.batch} x {a.seq_len}, "
          f"{'bf16 autocast' if bf16 else 'fp32'}, {name}; {flops_tok / 1e9:.2f} GFLOP/token")
    print("| model | params | step ms | step ms from an idle GPU | tokens/s | TFLOP/s | MFU | peak GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, n, s, idle, mem in rows:
        tps = a.batch * a.seq_len / s
        tf = tps * flops_tok / 1e12
        mfu = f"{100 * tf / a.peak_tflops:.1f}%" if a.peak_tflops else "—"
        print(f"| {label} | {n / 1e6:.1f}M | {s * 1e3:.1f} | {idle * 1e3:.1f} | {tps:,.0f} | {tf:.2f} | {mfu} | "
              f"{mem:.1f} |")
    if len(rows) == 2:
        print(f"gdn / fla tokens/s: {a.batch * a.seq_len / rows[0][2] / (a.batch * a.seq_len / rows[1][2]):.2f}x")


if __name__ == "__main__":
    main()
