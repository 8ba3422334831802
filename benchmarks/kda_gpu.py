"""Kimi Delta Attention on the GPU beside the scalar gate: gdn's Triton KDA vs FLA 0.6.0's KDA.

Chunked rows, at the shapes of ``benchmarks/ops_gpu.py`` (K = V = 128): (B, T, H) = (8, 2048, 16),
(4, 8192, 16), (1, 32768, 16); grouped values (1, 8192, H = 16, HV = 32); a packed batch of 12
sequences totalling 32768. Forward (under ``torch.no_grad``) and forward+backward, bf16 q/k/v,
fp32 g and beta. Implementations per row:

- ``gdn KDA``: ``gdn.ops.kimi_delta_attention(..., backend="triton")``, which at these lengths runs
  the chunkwise kernels (``gdn/ops/kda/triton/chunk*.py``); ``gdn KDA recurrent`` (``--recurrent``):
  the token-recurrent kernels (``gdn.ops.kda.triton.recurrent.recurrent_kda``), the op's decode path;
- ``FLA chunk``: ``fla.ops.kda.chunk_kda`` with its default flags: g is the per-channel log decay
  (natural log; FLA rescales it to base 2 itself), beta is used as given (no sigmoid), q/k are
  not normalised in the kernel, scale K^-1/2 — the convention of gdn's op;
- ``FLA recurrent``: ``fla.ops.kda.fused_recurrent_kda`` (forward only: it has no backward);
- ``gdn scalar``: ``gdn.ops.gated_delta_rule(..., backend="triton")`` with a [B, T, HV] gate, the
  same shapes otherwise (the scalar-gate figure the KDA rows sit beside).

Per row: median ms (``triton.testing.do_bench``; a call too slow for the step's time gets the
median of a few CUDA-event timings, marked ``*``), the time relative to FLA chunk and to the
scalar gate, peak memory above the inputs of one call, the first call's seconds (compiles and FLA's
autotuning included; the forward+backward's after the forward's at that shape, so its backward's
alone), and — at the first shape only — the
relative RMS error ``‖x − x_ref‖ / ‖x_ref‖`` against gdn's PyTorch chunk form
(:mod:`gdn.ops.kda.chunk`) run in fp32 on the same inputs: of the output for the forward row, the
largest over dq, dk, dv, dg, dβ for the forward+backward row (the scalar row's reference is the
chunk form with the gate broadcast along K, which is the same recurrence).

Decode rows: one token per sequence, B ∈ {1, 32, 256}, H = 16, HV = 32, K = V = 128, bf16
q/k/v/o, fp32 g/beta and fp32 state, state in and new state out. Timed through Python
(``do_bench`` of single launches: mostly launch overhead at small B) and as GPU time per step of a
CUDA graph of 100 steps (state sets rotated when they would sit in L2). gdn KDA in the graph is its
forward kernel launched directly with a precomputed layout: the op's wrapper builds the sequence
offsets on the host at every call, which a graph cannot replay. GB/s counts the state read and
written once plus q, k, v, g, β, o once, against a device copy measured in the same run. The
error column: the larger relative error of o and the new state against the fp32 recurrence
(:mod:`gdn.ops.kda.reference`, the gate broadcast along K for the scalar row). These columns
describe the timed calls; the correctness of the kernels, with bounds, is ``pytest tests/gpu``
(``tests/gpu/test_kda.py``).

Every timed configuration runs inside its own guard: an exception or its time running out prints a
FAIL row and the script goes on. ``--max-seconds`` bounds the whole run (configurations left when
it is spent print SKIP rows), of which ``--decode-seconds`` are kept for the decode rows, which
run last (a failed graph capture cannot then spoil the chunked rows); ``--step-seconds`` bounds
the timing of one configuration (its first, compiling call — FLA autotunes there — is bounded
only by what is left of the run). Rows print as they finish; the tables print at the end, also
when the run is cut short (SIGTERM from ``timeout`` included).

``--impls`` names the implementations to time (default all but ``gdn KDA recurrent``); ``--json``
rewrites a JSON file of the rows after every one, so a run that is cut short keeps them. With
TileLang importable (FlashQLA's wheels installed beside FLA) FLA 0.6.0 would run one kernel of
``chunk_kda``'s backward in TileLang: ``FLA_TILELANG=0`` is set before FLA is imported, so the FLA
rows are its Triton kernels, unless ``--fla-tilelang``.

    python benchmarks/kda_gpu.py [--max-seconds 300] [--step-seconds 30] [--no-fla] [--no-decode]
                                 [--recurrent] [--no-check] [--impls "gdn KDA,FLA chunk"] [--json PATH]
    python benchmarks/kda_gpu.py --profile --shapes 0              # per-kernel µs, gdn KDA and FLA chunk
    TRITON_INTERPRET=1 python benchmarks/kda_gpu.py --dry-run      # plumbing on the CPU, tiny shapes
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn import ops  # noqa: E402
from gdn.checkpoint import atomic_write_text  # noqa: E402
from gdn.ops import tuning  # noqa: E402
from gdn.ops.kda import chunk as kda_chunk  # noqa: E402
from gdn.ops.kda import reference as kda_reference  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_gpu import per_step_in_graph_us  # noqa: E402  (one CUDA-graph timer for both)
from ops_gpu import clean, fla_backends, fresh_fwd_bwd, kernel_times  # noqa: E402  (JSON cleaning, FLA's backends, the per-kernel profile: shared)

PACKED = [4096, 1000, 7000, 300, 2048, 5000, 64, 3000, 1500, 4260, 2500, 2000]
#: (name, B, T, H, HV, D, packed lengths or None)
SHAPES = [
    ("(8, 2048, 16, 128)", 8, 2048, 16, 16, 128, None),
    ("(4, 8192, 16, 128)", 4, 8192, 16, 16, 128, None),
    ("(1, 32768, 16, 128)", 1, 32768, 16, 16, 128, None),
    ("(1, 8192, H=16, HV=32, 128)", 1, 8192, 16, 32, 128, None),
    ("packed 12 seqs, 32768", 1, 32768, 16, 16, 128, PACKED),
]
DRY_SHAPES = [
    ("(2, 40, 2, 16)", 2, 40, 2, 2, 16, None),
    ("(1, 24, H=1, HV=2, 16)", 1, 24, 1, 2, 16, None),
    ("packed 3 seqs, 40", 1, 40, 2, 2, 16, [17, 3, 20]),
]
DECODE = dict(H=16, HV=32, D=128, batches=(1, 32, 256))
DRY_DECODE = dict(H=1, HV=2, D=16, batches=(1, 3))
IMPLS = ["gdn KDA", "gdn KDA recurrent", "FLA chunk", "FLA recurrent", "gdn scalar"]


def parse_impls(text: str) -> list[str]:
    """``"gdn KDA, fla chunk"`` → those of IMPLS, in IMPLS' order (names matched ignoring case);
    an unknown name raises ValueError."""
    by = {i.lower(): i for i in IMPLS}
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in by]
    if unknown or not names:
        raise ValueError(f"unknown implementations {unknown}: choose from {', '.join(IMPLS)}")
    return [i for i in IMPLS if i.lower() in names]


class StepTimeout(Exception):
    """Raised by the alarm when a step's time is spent."""


def _on_alarm(signum, frame):
    raise StepTimeout("step time spent")


def _on_term(signum, frame):
    raise SystemExit(f"terminated by signal {signum}: printing what finished")


class Clock:
    """The run's deadline; ``guard`` runs one step under an alarm and turns its failure into a status."""

    def __init__(self, max_seconds: float):
        self.deadline = time.monotonic() + max_seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def guard(self, fn, seconds: float | None = None):
        """``(result, None)`` or ``(None, "FAIL: ...")`` / ``(None, "SKIP: ...")``; at most
        ``min(seconds, time left)``."""
        limit = self.left() if seconds is None else min(seconds, self.left())
        if limit <= 0.5:
            return None, "SKIP: time budget spent"
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            return fn(), None
        except StepTimeout:
            return None, f"FAIL: over its {limit:.0f} s"
        except Exception as e:  # noqa: BLE001 - one configuration's failure must not end the run
            if "StepTimeout" in repr(e):  # wrapped by the code it interrupted (the Triton interpreter)
                return None, f"FAIL: over its {limit:.0f} s"
            return None, f"FAIL: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)


# ----------------------------------------------------------------------------------------- timing
def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, device, budget_s, grad_to_none=None):
    """(median ms, how): ``do_bench`` when ~12 calls fit in ``budget_s``, else the median of as many
    single timings (at least one, at most five) as fit."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    est = time.perf_counter() - t0
    if device == "cuda" and est * 12 <= budget_s:
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=60, grad_to_none=grad_to_none, return_mode="median"), "do_bench"
    n = max(1, min(5, int(budget_s / max(est, 1e-9)) - 1))
    times = []
    for _ in range(n):
        for x in grad_to_none or ():
            x.grad = None
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), f"median of {n}"


def peak_gib(fn, device, tensors=()):
    """Peak memory above what is allocated before one call (``tensors``' grads dropped first), GiB
    (nan off CUDA)."""
    if device != "cuda":
        return math.nan
    for t in tensors:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def rel(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm())


# ------------------------------------------------------------------------------- implementations
def fla_kda():
    """(chunk_kda, fused_recurrent_kda) from FLA, or raise ImportError."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    return chunk_kda, fused_recurrent_kda


def make_inputs(B, T, H, HV, D, device, dtype, seed=0):
    """bf16 (or ``dtype``) q, k (L2-normalised), v; fp32 per-channel g [B,T,HV,D], scalar g [B,T,HV]
    and beta, all requiring grad; and the output cotangent."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = rnd(B, T, H, D).to(dtype)
    k = torch.nn.functional.normalize(rnd(B, T, H, D), dim=-1).to(dtype)
    v = rnd(B, T, HV, D).to(dtype)
    g = torch.nn.functional.logsigmoid(rnd(B, T, HV, D) + 3)
    gs = torch.nn.functional.logsigmoid(rnd(B, T, HV) + 3)
    beta = torch.rand(B, T, HV, generator=gen).to(device)
    do = rnd(B, T, HV, D).to(dtype)
    return {n: x.requires_grad_(True) for n, x in dict(q=q, k=k, v=v, g=g, gs=gs, beta=beta).items()}, do


def impl_fn(name, x, cu, device, on_cpu):
    """A zero-argument callable returning the output o [B, T, HV, D] of implementation ``name``."""
    q, k, v, g, gs, beta = x["q"], x["k"], x["v"], x["g"], x["gs"], x["beta"]
    if name == "gdn KDA":
        if on_cpu:  # the op refuses backend="triton" off CUDA; the kernels themselves run interpreted
            from gdn.ops.kda.triton.chunk import chunk_kda

            return lambda: chunk_kda(q, k, v, g, beta, cu_seqlens=cu)[0]
        return lambda: ops.kimi_delta_attention(q, k, v, g, beta, cu_seqlens=cu, backend="triton")[0]
    if name == "gdn KDA recurrent":
        from gdn.ops.kda.triton.recurrent import recurrent_kda

        return lambda: recurrent_kda(q, k, v, g, beta, cu_seqlens=cu)[0]
    if name == "gdn scalar":
        if on_cpu:
            return lambda: ops.gated_delta_rule(q, k, v, gs, beta, cu_seqlens=cu, backend="chunk")[0]
        return lambda: ops.gated_delta_rule(q, k, v, gs, beta, cu_seqlens=cu, backend="triton")[0]
    chunk_kda, fused_recurrent_kda = fla_kda()
    cu_dev = None if cu is None else cu.to(device, torch.long)
    if name == "FLA chunk":
        cu_cpu = None if cu is None else cu.long()
        return lambda: chunk_kda(q, k, v, g, beta, cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu)[0]
    if name == "FLA recurrent":
        return lambda: fused_recurrent_kda(q, k, v, g, beta, cu_seqlens=cu_dev)[0]
    raise ValueError(f"unknown implementation {name!r}")


def forward_only(f):
    def run():
        with torch.no_grad():
            return f()
    return run


def references(x, do, cu):
    """fp32 chunk-form outputs and gradients: {"kda": (o, grads), "scalar": (o, grads)}."""
    out = {}
    for kind in ("kda", "scalar"):
        xs = {n: t.detach().float().requires_grad_(True) for n, t in x.items()}
        K = xs["q"].shape[-1]
        g = xs["g"] if kind == "kda" else xs["gs"][..., None].expand(*xs["gs"].shape, K)
        o, _ = kda_chunk.kimi_delta_attention(xs["q"], xs["k"], xs["v"], g, xs["beta"], cu_seqlens=cu)
        names = ["q", "k", "v", "g" if kind == "kda" else "gs", "beta"]
        grads = torch.autograd.grad(o, [xs[n] for n in names], do.float())
        out[kind] = (o.detach(), dict(zip(names, grads)))
        del o, xs
    return out


def grad_error(x, names, ref_grads):
    return max(rel(x[n].grad, ref_grads[n]) for n in names)


# --------------------------------------------------------------------------------- chunked rows
def shape_rows(spec, impls, clock, args, report, check):
    """Time every implementation at one shape, forward then forward+backward; ``check``: errors too."""
    name, B, T, H, HV, D, lens = spec
    device, on_cpu = args.device, args.device == "cpu"
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    made, status = clock.guard(lambda: make_inputs(B, T, H, HV, D, device, args.dtype))
    if status:
        for impl in impls:
            for p in ("fwd", "fwd+bwd"):
                report(dict(shape=name, pass_=p, impl=impl, status=status))
        return
    x, do = made
    refs = None
    if check:
        refs, status = clock.guard(lambda: references(x, do, cu), args.step_seconds * 2)
        if status:
            print(f"reference at {name}: {status}", flush=True)
    for p in ("fwd", "fwd+bwd"):
        for impl in impls:
            row = dict(shape=name, pass_=p, impl=impl)
            if impl == "FLA recurrent" and p == "fwd+bwd":
                row["status"] = "n/a (forward only)"
                report(row)
                continue
            made_fn, status = clock.guard(lambda: impl_fn(impl, x, cu, device, on_cpu))
            if status:
                report({**row, "status": status})
                continue
            fn = forward_only(made_fn) if p == "fwd" else fresh_fwd_bwd(made_fn, (), do)
            tensors = list(x.values())

            def first():
                for t in tensors:
                    t.grad = None
                sync(device)
                t0 = time.perf_counter()
                out = fn()
                sync(device)
                return time.perf_counter() - t0, out

            res, status = clock.guard(first)  # compiles: bounded by the run's deadline only
            if status:
                report({**row, "status": status})
                continue
            row["first_s"], out = res
            if refs is not None:
                ref_o, ref_g = refs["scalar" if impl == "gdn scalar" else "kda"]
                row["err"], status = clock.guard(
                    lambda: rel(out, ref_o) if p == "fwd" else grad_error(x, list(ref_g), ref_g), args.step_seconds)
                if status:
                    row["err_status"] = status
            del out
            timing, status = clock.guard(
                lambda: bench_ms(fn, device, args.step_seconds * 0.8, tensors if p == "fwd+bwd" else None),
                args.step_seconds)
            if status:
                report({**row, "status": status})
                continue
            row["ms"], row["how"] = timing
            row["peak_gib"], status = clock.guard(lambda: peak_gib(fn, device, tensors), args.step_seconds)
            if status:
                row["peak_status"] = status
            row["status"] = "ok"
            report(row)
    del x, do, refs
    if device == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------- decode
def copy_bandwidth():
    """Device-to-device copy of 2 GiB: bytes read + written per second."""
    from triton.testing import do_bench

    x = torch.empty(2**29, dtype=torch.float32, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() * 4 / (ms * 1e-3)


def decode_bytes(B, H, HV, D, per_channel_gate=True):
    """State read and written (fp32), q, k, v, o (bf16), g (fp32, [HV, D] or [HV]) and beta (fp32) once."""
    state = B * HV * D * D * 4 * 2
    return state + B * (2 * H * D * 2 + 2 * HV * D * 2 + HV * (D if per_channel_gate else 1) * 4 + HV * 4)


def decode_set(B, H, HV, D, device, dtype, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = rnd(B, 1, H, D).to(dtype)
    k = torch.nn.functional.normalize(rnd(B, 1, H, D), dim=-1).to(dtype)
    v = rnd(B, 1, HV, D).to(dtype)
    g = torch.nn.functional.logsigmoid(rnd(B, 1, HV, D) + 3)
    gs = torch.nn.functional.logsigmoid(rnd(B, 1, HV) + 3)
    beta = torch.rand(B, 1, HV, generator=gen).to(device)
    h0 = rnd(B, HV, D, D) * 0.1
    return dict(q=q, k=k, v=v, g=g, gs=gs, beta=beta, h0=h0)


def decode_fn(impl, s, on_cpu, in_graph):
    """A zero-argument decode step (state in, new state out) returning (o, new state)."""
    q, k, v, g, gs, beta, h0 = (s[n] for n in ("q", "k", "v", "g", "gs", "beta", "h0"))
    if impl == "gdn KDA":
        from gdn.ops.kda.triton import recurrent as TK

        if not in_graph:
            if on_cpu:  # what the router takes for a decode step on CUDA
                return lambda: TK.recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
            return lambda: ops.kimi_delta_attention(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                    backend="triton")
        return kda_kernel_step(TK, q, k, v, g, beta, h0)
    if impl == "gdn scalar":
        backend = "naive" if on_cpu else "triton"
        return lambda: ops.gated_delta_rule(q, k, v, gs, beta, initial_state=h0, output_final_state=True,
                                            backend=backend)
    if impl == "FLA recurrent":
        _, fused_recurrent_kda = fla_kda()
        return lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    raise ValueError(f"no decode row for {impl!r}")


def kda_kernel_step(TK, q, k, v, g, beta, h0):
    """gdn's KDA forward kernel for one decode step, layout and outputs prepared once (graph-safe)."""
    import triton

    B, _, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cu, ck_off, _, N = TK._checkpoints(B, 1, None, q.device)
    BK, BV = tuning.kda_recurrent_tiles(K, V)
    o = torch.empty_like(v)
    ht = torch.empty_like(h0)
    grid = (triton.cdiv(V, BV), N * HV)

    def step():
        TK._kda_fwd_kernel[grid](q, k, v, g, beta, o, h0, ht, o, cu, ck_off, K ** -0.5, H=H, HV=HV, K=K, V=V,
                                 BK=BK, BV=BV, CKS=tuning.OTHER["kda_recurrent"]["CK"], USE_H0=True, STORE_HT=True,
                                 STORE_CKPT=False)
        return o, ht
    return step


def decode_rows(impls, clock, args, report):
    """One dict per (B, implementation): µs through Python, µs per step in a graph, state error."""
    cfg = DRY_DECODE if args.dry_run else DECODE
    H, HV, D = cfg["H"], cfg["HV"], cfg["D"]
    on_cpu = args.device == "cpu"
    copy_bw = math.nan
    if not on_cpu:
        copy_bw, status = clock.guard(copy_bandwidth, args.step_seconds)
        if status:
            print(f"copy bandwidth: {status}", flush=True)
            copy_bw = math.nan
    impls = [i for i in impls if i not in ("FLA chunk", "gdn KDA recurrent")]
    for B in cfg["batches"]:
        rot = 4 if B * HV * D * D * 4 < 256 * 2**20 else 1
        sets, status = clock.guard(lambda: [decode_set(B, H, HV, D, args.device, args.dtype, i) for i in range(rot)])
        if status:
            for impl in impls:
                report(dict(B=B, impl=impl, status=status))
            continue
        d = {n: t.float() for n, t in sets[0].items()}
        refs = {kind: kda_reference.kimi_delta_attention(d["q"], d["k"], d["v"], gate, d["beta"],
                                                         initial_state=d["h0"], output_final_state=True)
                for kind, gate in (("kda", d["g"]), ("scalar", d["gs"][..., None].expand_as(d["g"])))}
        for impl in impls:
            row = dict(B=B, impl=impl, bytes=decode_bytes(B, H, HV, D, impl != "gdn scalar"), copy_bw=copy_bw)

            def python_launch():
                fns = [decode_fn(impl, s, on_cpu, False) for s in sets]
                with torch.inference_mode():
                    o, S = fns[0]()
                    ref = refs["scalar" if impl == "gdn scalar" else "kda"]
                    err = max(rel(o, ref[0]), rel(S, ref[1]))
                    it = iter(range(10**9))
                    ms, how = bench_ms(lambda: fns[next(it) % rot](), args.device, args.step_seconds * 0.5)
                return err, ms * 1e3, how

            res, status = clock.guard(python_launch, args.step_seconds)
            if status:
                report({**row, "status": status})
                continue
            row["err"], row["python_us"], row["how"] = res
            if not on_cpu:
                res, status = clock.guard(
                    lambda: per_step_in_graph_us([decode_fn(impl, s, on_cpu, True) for s in sets]), args.step_seconds)
                row["graph_us"] = res if status is None else math.nan
                if status:
                    row["graph_status"] = status
            row["status"] = "ok"
            report(row)


# ---------------------------------------------------------------------------------------- tables
def fmt(x, spec=".3f"):
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def times_x(x, spec):
    return f"{x:{spec}}×" if x == x else "-"


def chunk_table(rows, impls):
    head = ("| shape | pass | " + " | ".join(f"{i} ms" for i in impls)
            + " | gdn KDA speed vs FLA chunk (FLA ms / gdn ms) | gdn KDA time / gdn scalar time"
            + " | peak GiB " + " / ".join(impls)
            + " | first call s " + " / ".join(impls)
            + " | rel. error vs fp32 chunk form, " + " / ".join(impls) + " |")
    lines = [head, "|" + "---|" * (len(impls) + 7)]
    keys = []
    for r in rows:
        if (r["shape"], r["pass_"]) not in keys:
            keys.append((r["shape"], r["pass_"]))
    notes = []
    for shape, p in keys:
        by = {r["impl"]: r for r in rows if r["shape"] == shape and r["pass_"] == p}

        def ms(i):
            r = by.get(i)
            if r is None:
                return "-"
            if r.get("status") != "ok":
                return "n/a" if r.get("status", "").startswith("n/a") else r["status"].split(":")[0]
            return fmt(r["ms"]) + ("*" if r.get("how") != "do_bench" else "")

        def val(i, key):
            r = by.get(i)
            return math.nan if r is None or r.get("status") != "ok" else r.get(key, math.nan)

        kda, fla, scal = val("gdn KDA", "ms"), val("FLA chunk", "ms"), val("gdn scalar", "ms")
        ratio_fla = fla / kda if kda == kda and fla == fla else math.nan
        ratio_scal = kda / scal if kda == kda and scal == scal else math.nan
        peaks = " / ".join(fmt(val(i, "peak_gib"), ".2f") or "-" for i in impls)
        firsts = " / ".join(fmt(val(i, "first_s"), ".2f") or "-" for i in impls)
        errs = " / ".join(fmt(by[i].get("err") if i in by else None, ".1e") or "-" for i in impls)
        times = " | ".join(ms(i) for i in impls)
        lines.append(f"| {shape} | {p} | {times} | {times_x(ratio_fla, '.2f')} | {times_x(ratio_scal, '.1f')} "
                     f"| {peaks} | {firsts} | {errs} |")
        notes += [f"{shape} {p} {i}: {r['status']}" for i, r in by.items() if r.get("status", "").startswith("FAIL")]
        notes += [f"{shape} {p} {i} ({what}): {r[key]}" for i, r in by.items()
                  for what, key in (("error", "err_status"), ("peak memory", "peak_status")) if key in r]
    return "\n".join(lines + ([""] + notes if notes else []))


def decode_table(rows, impls):
    impls = [i for i in impls if i not in ("FLA chunk", "gdn KDA recurrent")]
    lines = ["| B | " + " | ".join(f"{i} via Python µs" for i in impls) + " | "
             + " | ".join(f"{i} in graph µs/step" for i in impls) + " | "
             + " | ".join(f"{i} GB/s (% copy)" for i in impls)
             + " | rel. error of o and state (larger), " + " / ".join(impls) + " |",
             "|" + "---|" * (3 * len(impls) + 2)]
    notes = []
    for B in sorted({r["B"] for r in rows}):
        by = {r["impl"]: r for r in rows if r["B"] == B}

        def get(i, key):
            r = by.get(i)
            return math.nan if r is None or r.get("status") != "ok" else r.get(key, math.nan)

        def cell(i, key, spec):
            r = by.get(i)
            if r is None or (key not in r and r.get("status") == "ok"):
                return "-"
            return fmt(get(i, key), spec) or "FAIL"

        cells = [cell(i, "python_us", ".1f") for i in impls] + [cell(i, "graph_us", ".2f") for i in impls]
        for i in impls:
            us = get(i, "graph_us")
            r = by.get(i, {})
            gbps = r.get("bytes", 0) / (us * 1e-6) / 1e9 if us == us else math.nan
            pct = 100 * gbps * 1e9 / r.get("copy_bw", math.nan)
            cells.append(f"{fmt(gbps, '.0f')} ({fmt(pct, '.0f')}%)" if gbps == gbps else "")
        errs = " / ".join(fmt(get(i, "err"), ".1e") or "-" for i in impls)
        lines.append(f"| {B} | " + " | ".join(cells) + f" | {errs} |")
        notes += [f"B={B} {i}: {r.get('graph_status') or r.get('status')}" for i, r in by.items()
                  if r.get("status") != "ok" or r.get("graph_status")]
    return "\n".join(lines + ([""] + notes if notes else []))


def print_tables(chunk_rows, dec_rows, impls, args, started):
    import triton

    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (interpreted Triton)"
    fla_v = "not used"
    if "FLA chunk" in impls or "FLA recurrent" in impls:
        try:
            from importlib.metadata import version

            fla_v = version("fla-core")
        except Exception:  # noqa: BLE001 - the version is only a caption
            fla_v = "unknown version"
    print()
    print(f"{dev}, torch {torch.__version__}, triton {triton.__version__}, FLA {fla_v}, "
          f"{datetime.date.today()}, {args.dtype} q/k/v, fp32 g/beta; run took {time.monotonic() - started:.0f} s.")
    if chunk_rows:
        print("\nKimi Delta Attention, chunked (prefill/training) calls; '*' = median of a few single timings "
              "(call too slow for do_bench in the step's time):\n")
        print(chunk_table(chunk_rows, impls))
    if dec_rows:
        print("\nDecode, one token, fp32 state in and new state out:\n")
        print(decode_table(dec_rows, impls))
    sys.stdout.flush()


def profile(shapes, impls, dtype):
    """Per-kernel GPU µs per call of each implementation, forward (no grad) and forward+backward."""
    for name, B, T, H, HV, D, lens in shapes:
        cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        x, do = make_inputs(B, T, H, HV, D, "cuda", dtype)
        for impl in impls:
            f = impl_fn(impl, x, cu, "cuda", False)
            kernel_times(forward_only(f), f"{impl} at {name}, forward")
            kernel_times(fresh_fwd_bwd(f, x.values(), do), f"{impl} at {name}, forward+backward")
        del x, do
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-seconds", type=float, default=300, help="wall-clock budget of the whole run")
    ap.add_argument("--step-seconds", type=float, default=30, help="budget for timing one configuration")
    ap.add_argument("--decode-seconds", type=float, default=45,
                    help="part of --max-seconds kept for the decode rows (at most half)")
    ap.add_argument("--shapes", default=None, help="comma-separated indices into the shape list (default all)")
    ap.add_argument("--no-fla", action="store_true", help="leave FLA out")
    ap.add_argument("--no-decode", action="store_true", help="leave the decode rows out")
    ap.add_argument("--no-check", action="store_true", help="leave the error column out")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, FLA left out (plumbing test, CPU ok)")
    ap.add_argument("--recurrent", action="store_true", help="time the token-recurrent kernels in the chunked rows too")
    ap.add_argument("--impls", default=None, metavar="A,B",
                    help=f"the implementations to time, comma-separated, of: {', '.join(IMPLS)} "
                         "(default all but 'gdn KDA recurrent', which --recurrent adds)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON, rewritten after every row")
    ap.add_argument("--fla-tilelang", action="store_true",
                    help="let FLA run its TileLang kernel where it would (default FLA_TILELANG=0: its Triton kernels)")
    ap.add_argument("--profile", action="store_true",
                    help="instead of the tables: per-kernel GPU µs of the chosen implementations (default gdn KDA, "
                         "FLA chunk) at the chosen shapes, forward and forward+backward (torch.profiler)")
    ap.add_argument("--config", default=None, metavar="JSON",
                    help='launch settings to try, inline JSON or a file (gdn.ops.tuning.update_from), e.g. '
                         '\'{"kda.kkt": {"BK": 64}}\'')
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    tuning.apply_config(ap, args.config)
    fla_backends(args.fla_tilelang)
    on_cpu = args.device == "cpu"
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu runs the Triton kernels interpreted: set TRITON_INTERPRET=1")
    args.dtype = torch.float32 if on_cpu else torch.bfloat16  # numpy (the interpreter) has no bf16
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    try:
        chosen = (parse_impls(args.impls) if args.impls
                  else [i for i in IMPLS if args.recurrent or i != "gdn KDA recurrent"])
    except ValueError as e:
        ap.error(str(e))
    impls = [i for i in chosen if not (i.startswith("FLA") and (args.no_fla or args.dry_run))]
    if args.profile:
        if on_cpu:
            ap.error("--profile times CUDA kernels: it needs a GPU")
        profile(shapes, impls if args.impls else [i for i in impls if i in ("gdn KDA", "FLA chunk")], args.dtype)
        return

    started = time.monotonic()
    end = started + args.max_seconds
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGTERM, _on_term)
    chunk_rows, dec_rows = [], []
    left = end - time.monotonic()
    clock = Clock(left - (0 if args.no_decode else min(args.decode_seconds, left / 2)))

    def save():
        if args.json:
            atomic_write_text(args.json, json.dumps(clean(
                {"argv": sys.argv[1:], "impls": impls, "FLA_TILELANG": os.environ.get("FLA_TILELANG"),
                 "elapsed_s": time.monotonic() - started, "chunk": chunk_rows, "decode": dec_rows}), indent=1))

    def report(kind, into):
        def add(r):
            into.append(r)
            print(kind, {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            save()
        return add

    report_chunk, report_dec = report("ROW", chunk_rows), report("DECODE", dec_rows)

    torch.manual_seed(0)
    try:
        for n, spec in enumerate(shapes):
            shape_rows(spec, impls, clock, args, report_chunk, check=(n == 0 and not args.no_check))
        if not args.no_decode:
            decode_rows(impls, Clock(end - time.monotonic()), args, report_dec)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        print_tables(chunk_rows, dec_rows, impls, args, started)


if __name__ == "__main__":
    main()
