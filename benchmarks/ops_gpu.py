"""Chunked-op benchmark on the GPU: gdn's Triton kernels beside FLA 0.6.0 (Triton), FlashQLA and SDPA.

One process times every peer at each shape, side by side: ``gdn`` (``gdn.ops.gated_delta_rule``,
``backend="triton"``), ``fla`` (FLA 0.6.0's ``chunk_gated_delta_rule`` on its own Triton kernels),
``qla`` (FlashQLA 0.1.3's ``flash_qla.chunk_gated_delta_rule``, TileLang; K = V = 128 on NVIDIA
SM90/SM100 only, "n/a" elsewhere) and ``sdpa`` (PyTorch's flash attention at the same shape, for
scale). ``--peers`` picks them.

Rows, bf16 q/k/v (``--dtype fp16`` or ``fp32`` for the other input dtypes gdn takes; FlashQLA's
cells are then "n/a" in fp32, which it does not take), fp32 g and beta (index: shape; ``--shapes`` takes indices, in the order to run):
0 (8, 2048, 16, 128); 1 (4, 8192, 16, 128); 2 (1, 32768, 16, 128) (the same tokens per call at three
sequence lengths); 3 grouped values (1, 8192, H = 16, HV = 32, 128); 4 a packed batch of 12
sequences of mixed lengths totalling 32768; 5 one layer of the 340m model (K = 128, V = 256); 6 the
Qwen3.5-397B layer layout (1, 32768, H = 16, HV = 64, 128). The default order puts the rows FlashQLA
is measured at first: 1, 2, 6, 0, 3, 4, 5. Forward (under ``torch.no_grad``) and forward+backward;
``--decode`` adds the rows of ``benchmarks/decode_gpu.py``. Timing only: correctness is
``pytest tests/gpu``; the forward rows also give each peer's relative difference of o from gdn's,
a check that the peers were called with the same problem.

Per row and peer: median ms (``triton.testing.do_bench``), gdn's speed-up over FLA and FlashQLA
(their ms / gdn's ms), peak memory above the inputs of one call (gradients included, GiB), and the
seconds of the peer's first call at that shape and pass (compilation and autotuning; the
forward+backward figure comes after the forward's, so it is the backward's extra). Before the
first row a trivial Triton kernel runs once, so that Triton's one-time setup in a process (with an
empty cache: building its CUDA helper module) is not charged to the first shape's peer. For gdn also the
achieved TFLOP/s and GB/s, counted as below, against the card's ceilings measured in the same run
(a bf16 8192³ matmul and a device-to-device copy).

FLOPs counted (chunk size C = 64, per token and value head, the matmuls of the chunk algorithm):
forward 2·(3CK + 2CV + 3KV); forward+backward counted as 3× forward. Bytes: each input read
once and each output written once (forward: q, k, v, g, beta, o; backward: those again, dO,
and every gradient).

Routing in FLA 0.6.0: its ``chunk_gated_delta_rule`` goes to FlashQLA when ``flash_qla`` imports and
K = V = 128, unless ``FLA_FLASH_QLA=0``: this script sets that before FLA is imported, so the FLA
column is FLA's Triton path and FlashQLA is called directly. With TileLang importable FLA would also
run its gated backward's dq/dk/dw/dg kernel in TileLang on Hopper (its answer to FLA issue #640);
``FLA_TILELANG=0`` keeps that kernel in Triton unless ``--fla-tilelang``. FLA 0.6.0 refuses that
Triton kernel under triton 3.6 on Hopper (issue #640, a miscompile); to time it anyway this script
sets ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True``: FLA's fwd+bwd figures are timed, not
checked.

FlashQLA compiles its kernels on the first call at each new configuration (15–140 s): its first
calls together get ``--max-compile-s``; when that is spent its remaining cells are skipped with a
note (``--qla-shapes`` narrows its rows). Any peer's failure prints one line and marks its cell
"err"; the table goes on. Each row prints when done; ``--json`` rewrites a JSON file after every
row, so a run that is cut short keeps what it measured; the whole table prints at the end, also on
SIGTERM.

``--graph`` times each call captured in a CUDA graph and replayed instead (gdn under each
``--variants`` entry): where the host's time per call exceeds the kernels' (a slow host, a small
shape) the wall times above are the host's, these are the GPU's, for every peer alike.

    python benchmarks/ops_gpu.py [--peers gdn,fla,qla,sdpa] [--shapes 1,2,6] [--json out.json]
                                 [--max-seconds 500] [--max-compile-s 210] [--profile] [--decode]
    python benchmarks/ops_gpu.py --graph --peers gdn,qla --shapes 0,2 [--variants '[{}, {"fused_bwd": {"NS": 3}}]']
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import signal
import sys
import time

# FLA's chunk_gated_delta_rule would run FlashQLA's kernels at K = V = 128: the FLA column is FLA's own
os.environ["FLA_FLASH_QLA"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn import ops  # noqa: E402
from gdn.checkpoint import atomic_write_text  # noqa: E402

C = 64
PACKED = [4096, 1000, 7000, 300, 2048, 5000, 64, 3000, 1500, 4260, 2500, 2000]
#: (name, B, T, H, HV, packed lengths or None[, V]); K = D, V = D unless given
SHAPES = [
    ("(8, 2048, 16, 128)", 8, 2048, 16, 16, None),
    ("(4, 8192, 16, 128)", 4, 8192, 16, 16, None),
    ("(1, 32768, 16, 128)", 1, 32768, 16, 16, None),
    ("(1, 8192, H=16, HV=32, 128)", 1, 8192, 16, 32, None),
    ("packed 12 seqs, 32768", 1, 32768, 16, 16, PACKED),
    # one layer of the 340m model in training (benchmarks/train.py): 6 heads, K = 128, V = 256
    ("340m layer (4, 4096, 6, K=128, V=256)", 4, 4096, 6, 6, None, 256),
    # Qwen3.5-397B's Gated DeltaNet layers: 16 query/key heads, 64 value heads
    ("Qwen3.5-397B (1, 32768, H=16, HV=64, 128)", 1, 32768, 16, 64, None),
]
D = 128
#: where the inputs are made (the CPU test of the table's plumbing sets "cpu")
DEVICE = "cuda"
#: the dtype of q, k, v and dO (--dtype); g and beta are fp32 throughout
IO = torch.bfloat16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: the run order without --shapes: FlashQLA's compile budget goes to these rows first
DEFAULT_ORDER = [1, 2, 6, 0, 3, 4, 5]
PEERS = ["gdn", "fla", "qla", "sdpa"]
LABELS = {"gdn": "gdn", "fla": "FLA", "qla": "FlashQLA", "sdpa": "SDPA"}
#: peers gdn's speed-up is given against
VERSUS = ["fla", "qla"]


def parse_peers(text: str) -> list[str]:
    """``"gdn,fla,qla"`` → the named peers in the table's order; unknown or no names raise ValueError."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise ValueError(f"unknown peers {unknown} (choose from {','.join(PEERS)})" if unknown else "no peers named")
    return [p for p in PEERS if p in names]


def parse_indices(text: str, n: int) -> list[int]:
    """``"1,2,6"`` → [1, 2, 6], each an index into a list of ``n`` (in the order given, repeats dropped)."""
    out = []
    for part in text.split(","):
        if not part.strip():
            continue
        i = int(part)
        if not 0 <= i < n:
            raise ValueError(f"shape index {i} out of range 0..{n - 1}")
        if i not in out:
            out.append(i)
    return out


def qla_supported(K: int, V: int) -> bool:
    """FlashQLA 0.1.3's kernels take K = V = 128 only."""
    return K == V == 128


def ceilings():
    """(bf16 matmul FLOP/s, copy bytes/s) measured now."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median") * 1e-3
    x = torch.empty(2**29, device="cuda").normal_()
    y = torch.empty_like(x)
    cp = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median") * 1e-3
    return 2 * 8192**3 / mm, 2 * x.numel() * 4 / cp


@triton.jit
def _touch_kernel(x):
    tl.store(x, tl.load(x) + 1)


def triton_ready():
    """Run a trivial Triton kernel once: the process's one-time Triton setup done before any peer."""
    x = torch.zeros(1, device="cuda")
    _touch_kernel[(1,)](x)
    torch.cuda.synchronize()


def counts(B, T, H, HV, V=D):
    tokens = B * T
    fwd_flops = tokens * HV * 2 * (3 * C * D + 2 * C * V + 3 * D * V)
    e = torch.finfo(IO).bits // 8
    ins = tokens * (2 * H * D * e + HV * V * e + HV * 4 * 2)  # q, k, v in IO; g, beta fp32
    out = tokens * HV * V * e
    return fwd_flops, 3 * fwd_flops, ins + out, 2 * ins + 2 * out + ins


def inputs(B, T, H, HV, lens, V=D, device=None):
    device = device or DEVICE  # (read at call time: tests point DEVICE elsewhere)
    q = torch.randn(B, T, H, D, device=device, dtype=IO)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=device), dim=-1).to(IO)
    v = torch.randn(B, T, HV, V, device=device, dtype=IO)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device=device) + 3)
    beta = torch.rand(B, T, HV, device=device).sigmoid()
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return [x.requires_grad_(True) for x in (q, k, v, g, beta)], cu


def gdn_fn(xs, cu):
    return lambda: ops.gated_delta_rule(*xs, cu_seqlens=cu, backend="triton")[0]


def fla_fn(xs, cu):
    try:
        import fla.ops.common.chunk_o as fla_chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # FLA refuses its gated backward on triton 3.6 / Hopper otherwise
    cu_dev = None if cu is None else cu.to("cuda", torch.long)
    return lambda: chunk_gated_delta_rule(*xs, cu_seqlens=cu_dev, cu_seqlens_cpu=None if cu is None else cu.long())[0]


_QLA = {}


def qla_module():
    """``flash_qla``, imported on first use; a failed import raises again at every later use."""
    if "mod" not in _QLA:
        try:
            import flash_qla

            _QLA["mod"] = flash_qla
        except Exception as e:  # noqa: BLE001 - TileLang's import can fail in many ways (nvcc, z3, arch)
            _QLA["mod"] = f"{type(e).__name__}: {one_line(e)}"
    if isinstance(_QLA["mod"], str):
        raise ImportError(f"flash_qla did not import: {_QLA['mod']}")
    return _QLA["mod"]


def qla_fn(xs, cu):
    """FlashQLA's ``chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, ...)``: q, k
    [B, T, H, K], v [B, T, HV, V] with HV a multiple of H (value head j reads q/k head j // (HV/H),
    as gdn's), g (log decay) and beta [B, T, HV], scale K^-1/2 by default; packed sequences as B = 1
    with int32 offsets on the device; its automatic intra-card context parallelism left on (its
    default)."""
    qla = qla_module()
    cu_dev = None if cu is None else cu.to(DEVICE, torch.int32)
    return lambda: qla.chunk_gated_delta_rule(*xs, cu_seqlens=cu_dev)[0]


def sdpa_fn(B, T, HV, lens, V=D):
    """(call, its inputs): causal softmax attention with HV heads of width V at the same tokens."""
    q, k, v = (torch.randn(B, T, HV, V, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    if lens is None:
        def f():
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    else:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)

        def f():
            return ops.softmax_attention(q, k, v, cu_seqlens=cu)
    return f, [q, k, v]


def peer_call(peer, xs, cu, sd):
    """(zero-argument call returning o, the tensors whose gradients it fills) of ``peer`` at one shape."""
    if peer == "gdn":
        return gdn_fn(xs, cu), xs
    if peer == "fla":
        f = fla_fn(xs, cu)
        if f is None:
            raise ImportError("fla is not installed")
        return f, xs
    if peer == "qla":
        return qla_fn(xs, cu), xs
    if peer == "sdpa":
        return sd
    raise ValueError(peer)


def timed(f, backward, do, xs=None):
    def run():
        o = f()
        if backward:
            o.backward(do)
    return do_bench(run, warmup=5, rep=60, grad_to_none=xs, return_mode="median")


def peak(f, backward, do, grads=()):
    """Peak memory of one call above what is allocated before it (``grads``' gradients dropped
    first, so a backward's gradients count), GiB."""
    for x in grads:
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.set_grad_enabled(backward):
        o = f()
        if backward:
            o.backward(do)
    del o
    torch.cuda.synchronize()
    for x in grads:
        x.grad = None
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def measure(f, backward, do, grads):
    """One peer at one pass: ({"first_s", "ms", "GiB"}, o of the first call for a forward else None)."""
    for x in grads:
        x.grad = None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.set_grad_enabled(backward):
        o = f()
        if backward:
            o.backward(do)
    torch.cuda.synchronize()
    res = {"first_s": time.perf_counter() - t0}
    o = None if backward else o.detach()
    with torch.set_grad_enabled(backward):
        res["ms"] = timed(f, backward, do, grads if backward else None)
    res["GiB"] = peak(f, backward, do, grads)
    return res, o


def rel_diff(o, ref):
    """‖o − ref‖ / ‖ref‖ in fp32."""
    ref = ref.float()
    return float((o.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def one_line(e) -> str:
    s = str(e).strip()
    return s.splitlines()[0][:200] if s else ""


def qla_skip(K, V, index, qla_rows, spent, budget, left):
    """(status, note) saying why FlashQLA's cell is not measured, or None to measure it: "n/a" where
    its kernels do not apply, "skip" outside ``qla_rows`` (None: every row), once ``spent`` seconds
    reach ``budget`` or with under 30 s of the run left."""
    if not qla_supported(K, V):
        return "n/a", f"K = V = 128 only (K = {K}, V = {V})"
    if IO not in (torch.bfloat16, torch.float16):
        return "n/a", "16-bit inputs only"
    if torch.version.hip is not None:
        return "n/a", "NVIDIA only"
    if qla_rows is not None and index not in qla_rows:
        return "skip", "not in --qla-shapes"
    if spent >= budget:
        return "skip", f"--max-compile-s {budget:g} spent ({spent:.0f} s)"
    if left < 30:
        return "skip", "--max-seconds nearly spent"
    return None


def rows(out, rates, deadline=float("inf"), *, order=None, peers=("gdn", "fla", "sdpa"), qla_rows=None,
         max_compile_s=float("inf"), on_row=None):
    """Time every peer at the shapes ``order`` (indices into SHAPES, in the order to run; default
    all), appending each (shape, pass) row to ``out`` as it is measured and the card's ceilings
    (matmul FLOP/s, copy bytes/s) to ``rates`` first, so a run that is cut short keeps what it
    measured; ``on_row(row)`` is called after each. Shapes not started before ``deadline``
    (time.monotonic()) are skipped; FlashQLA's cells together get ``max_compile_s`` seconds."""
    mm_rate, copy_bw = ceilings()
    rates[:] = [mm_rate, copy_bw]
    triton_ready()
    print(markdown_header(peers), flush=True)
    qla_spent = 0.0
    for i in range(len(SHAPES)) if order is None else order:
        name, B, T, H, HV, lens, *vd = SHAPES[i]
        if time.monotonic() > deadline:
            print(f"skipped {name}: past --max-seconds", flush=True)
            continue
        V = vd[0] if vd else D
        xs, cu = inputs(B, T, H, HV, lens, V)
        do = torch.randn(B, T, HV, V, device=DEVICE, dtype=IO)
        sd = sdpa_fn(B, T, HV, lens, V) if "sdpa" in peers else None
        f_fwd, f_all, b_fwd, b_all = counts(B, T, H, HV, V)
        for bwd in (False, True):
            r = {"idx": i, "shape": name, "pass": "fwd+bwd" if bwd else "fwd", "B": B, "T": T, "H": H, "HV": HV,
                 "K": D, "V": V, "packed": lens, "peers": {}}
            ref_o = None
            for p in peers:
                cell = r["peers"][p] = {}
                if p == "qla":
                    why = qla_skip(D, V, i, qla_rows, qla_spent, max_compile_s, deadline - time.monotonic())
                    if why:
                        cell["status"], cell["note"] = why
                        continue
                t0 = time.monotonic()
                try:
                    f, grads = peer_call(p, xs, cu, sd)
                    res, o = measure(f, bwd, do, grads)
                    cell.update(res, status="ok")
                    if o is not None and p == "gdn":
                        ref_o = o
                    elif o is not None and ref_o is not None and p != "sdpa":
                        cell["o_rel_diff"] = rel_diff(o, ref_o)
                    del o
                except Exception as e:  # noqa: BLE001 - one peer's failure must not end the table
                    cell.update(status="err", error=f"{type(e).__name__}: {one_line(e)}",
                                first_s=time.monotonic() - t0)
                    print(f"{LABELS[p]} failed at {name} {r['pass']}: {cell['error']}", flush=True)
                    for x in xs + (sd[1] if sd else []):
                        x.grad = None
                    try:
                        torch.cuda.empty_cache()
                    except Exception:  # noqa: BLE001 - a broken context fails here too; the next call says so
                        pass
                if p == "qla":
                    qla_spent += cell.get("first_s", time.monotonic() - t0)
            gd = r["peers"].get("gdn", {})
            if gd.get("status") == "ok":
                flops, nbytes = (f_all, b_all) if bwd else (f_fwd, b_fwd)
                s = gd["ms"] * 1e-3
                r.update(tflops=flops / s / 1e12, pct_mm=100 * flops / s / mm_rate,
                         GBps=nbytes / s / 1e9, pct_copy=100 * nbytes / s / copy_bw)
            out.append(r)
            print(markdown_row(r, peers), flush=True)
            if on_row is not None:
                on_row(r)
            del ref_o
        del xs, sd
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ tables
def _num(cell, key, spec):
    """A cell's figure, or its status where it has none ("n/a", "skip", "err"), or "-"."""
    if not cell:
        return "-"
    if cell.get("status") != "ok":
        return cell.get("status") or "-"
    x = cell.get(key)
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _versus(peers):
    return [p for p in VERSUS if p in peers and "gdn" in peers]


def _diffs(peers):
    return [p for p in ("fla", "qla") if p in peers and "gdn" in peers]


def markdown_header(peers) -> str:
    cols = ["#", "shape", "pass"] + [f"{LABELS[p]} ms" for p in peers]
    cols += [f"gdn speed-up vs {LABELS[p]}" for p in _versus(peers)]
    if "gdn" in peers:
        cols += ["gdn TFLOP/s (% mm)", "gdn GB/s (% copy)"]
    cols += ["peak GiB " + " / ".join(LABELS[p] for p in peers), "first call s " + " / ".join(LABELS[p] for p in peers)]
    if _diffs(peers):
        cols.append("o rel. diff vs gdn, " + " / ".join(LABELS[p] for p in _diffs(peers)))
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def markdown_row(r, peers) -> str:
    cells = r["peers"]
    out = [str(r["idx"]), r["shape"], r["pass"]] + [_num(cells.get(p), "ms", ".3f") for p in peers]
    g = cells.get("gdn") or {}
    for p in _versus(peers):
        c = cells.get(p) or {}
        if g.get("status") == "ok" and c.get("status") == "ok":
            out.append(f"{c['ms'] / g['ms']:.2f}×")
        else:
            out.append(c.get("status") if c.get("status") not in (None, "ok") else "-")
    if "gdn" in peers:
        ok = g.get("status") == "ok" and "tflops" in r
        out.append(f"{r['tflops']:.0f} ({r['pct_mm']:.0f}%)" if ok else "-")
        out.append(f"{r['GBps']:.0f} ({r['pct_copy']:.0f}%)" if ok else "-")
    out.append(" / ".join(_num(cells.get(p), "GiB", ".3f") for p in peers))
    out.append(" / ".join(_num(cells.get(p), "first_s", ".2f") for p in peers))
    if _diffs(peers):
        out.append(" / ".join(_num(cells.get(p), "o_rel_diff", ".1e") for p in _diffs(peers))
                   if r["pass"] == "fwd" else "")
    return "| " + " | ".join(out) + " |"


def markdown(rs, peers) -> str:
    """The table of rows ``rs`` and, below it, one note per cell skipped or failed."""
    lines = [markdown_header(peers)] + [markdown_row(r, peers) for r in rs]
    notes = [f"- {r['shape']} {r['pass']} {LABELS[p]}: {c['status']}: {c.get('error') or c.get('note', '')}"
             for r in rs for p, c in r["peers"].items() if c.get("status") in ("err", "skip")]
    return "\n".join(lines + ([""] + notes if notes else []))


def versions():
    from importlib.metadata import version

    out = {"torch": torch.__version__, "triton": triton.__version__}
    for name in ("fla-core", "flash-qla", "tilelang"):
        try:
            out[name] = version(name)
        except Exception:  # noqa: BLE001 - only a caption
            out[name] = None
    return out


def dtype_name() -> str:
    """The --dtype name of the inputs' dtype (IO)."""
    return next(n for n, d in DTYPES.items() if d is IO)


def caption(mm_rate, copy_bw, peers) -> str:
    v = versions()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    lines = [f"{dev}, torch {v['torch']}, triton {v['triton']}, FLA {v['fla-core']}, FlashQLA {v['flash-qla']} "
             f"(TileLang {v['tilelang']}), {datetime.date.today()}. Ceilings measured in this run: bf16 matmul "
             f"{mm_rate / 1e12:.0f} TFLOP/s, copy {copy_bw / 1e9:.0f} GB/s. Gated DeltaNet, "
             f"{dtype_name()} q/k/v, fp32 g/beta."]
    if "fla" in peers:
        lines.append(f"FLA: FLA's Triton path (FLA_FLASH_QLA={os.environ.get('FLA_FLASH_QLA')}, "
                     f"FLA_TILELANG={os.environ.get('FLA_TILELANG', 'unset')}); fwd+bwd timed with "
                     "fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True (its guard for triton 3.6).")
    if "qla" in peers and os.environ.get("TILELANG_CACHE_DIR"):
        lines.append(f"FlashQLA's first calls read TileLang's cache at {os.environ['TILELANG_CACHE_DIR']}: a kernel "
                     "compiled there by an earlier run loads instead of compiling, so its first-call column is "
                     "not a cold compile.")
    lines.append("SDPA: torch's scaled_dot_product_attention (flash), causal, HV heads of width V. "
                 "Speed-up = peer ms / gdn ms. Peak GiB: one call above its inputs, gradients included. "
                 "First call s: the first call of that pass at that shape (fwd+bwd after the fwd).")
    return "\n".join(lines)


def table(rs, mm_rate, copy_bw, peers=("gdn", "fla", "sdpa")):
    """Print the markdown table of the rows measured."""
    print()
    print(caption(mm_rate, copy_bw, peers))
    print()
    print(markdown(rs, peers), flush=True)


def fla_backends(tilelang: bool) -> None:
    """FLA on its Triton kernels (``FLA_TILELANG=0``) unless ``tilelang``, and its log line for each
    other backend it first runs ("[FLA Backend] ... -> ...") shown. Before FLA is imported."""
    if tilelang:
        os.environ.pop("FLA_TILELANG", None)
    else:
        os.environ["FLA_TILELANG"] = "0"
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("fla.backends").setLevel(logging.INFO)


def clean(x):
    """``x`` with non-finite floats as None (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def write_json(path, meta, rs):
    """Write ``{"meta": meta, "rows": rs}`` to ``path`` whole (a temporary file, then renamed)."""
    atomic_write_text(path, json.dumps(clean({"meta": meta, "rows": rs}), indent=1))


def variants(specs, prof=False, shapes=None):
    """gdn alone at every shape under each launch-configuration variant (a JSON list of partial
    :func:`gdn.ops.tuning.update` arguments, e.g. ``[{}, {"split": {"L": -1}},
    {"state_fwd": {"num_warps": 8}}]``): ms and the largest relative difference of o and every
    gradient against the first variant, the forward + backward's peak memory above its inputs (GiB);
    with ``prof`` also the forward's per-kernel times under each."""
    import copy

    from gdn.ops import tuning

    saved = copy.deepcopy(tuning.TABLES)
    print("\n| shape | variant | fwd ms | fwd+bwd ms | peak GiB | max rel diff vs first |")
    print("|---|---|---|---|---|---|")
    for name, B, T, H, HV, lens, *vd in SHAPES if shapes is None else shapes:
        V = vd[0] if vd else D
        xs, cu = inputs(B, T, H, HV, lens, V)
        do = torch.randn(B, T, HV, V, device="cuda", dtype=IO)
        g = gdn_fn(xs, cu)
        base = None
        for spec in specs:
            tuning.restore(saved)
            try:
                tuning.update(spec)
                for x in xs:
                    x.grad = None
                o = g()
                o.backward(do)
                res = [o.float().clone()] + [x.grad.float().clone() for x in xs]
                if base is None:
                    base, diff = res, 0.0
                else:
                    diff = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(res, base))
                with torch.no_grad():
                    t_f = timed(g, False, do)
                t_b = timed(g, True, do, xs)
                gib = peak(g, True, do, xs)
            except Exception as e:  # noqa: BLE001 - one failing variant must not end the table
                print(f"| {name} | {json.dumps(spec)} | err | err | err | {one_line(e)} |", flush=True)
                continue
            print(f"| {name} | {json.dumps(spec)} | {t_f:.3f} | {t_b:.3f} | {gib:.3f} | {diff:.1e} |", flush=True)
            if prof:
                with torch.no_grad():
                    kernel_times(g, f"gdn kernels at {name}, {json.dumps(spec)}, fwd", top=8)
                    h_f = host_ms(g)
                run = fresh_fwd_bwd(g, xs, do)
                kernel_times(run, f"gdn kernels at {name}, {json.dumps(spec)}, fwd+bwd", top=14)
                print(f"gdn host ms at {name}, {json.dumps(spec)}: fwd {h_f:.3f}, fwd+bwd {host_ms(run):.3f}")
                host_times(run, f"gdn host at {name}, {json.dumps(spec)}, fwd+bwd")
        tuning.restore(saved)
        del xs
        torch.cuda.empty_cache()


def graph_ms(f, backward, do, grads=(), n=20, rounds=5):
    """GPU-bound milliseconds of one call of ``f`` (with ``backward``, its backward from ``do`` too):
    the call captured once in a CUDA graph after two eager calls on the capture's stream, then
    replayed ``n`` times back to back between two events, ``rounds`` times; the median of the
    rounds' means. No host work runs between a replay's kernels, so this is what the kernels and
    the gaps between them take, as on a host quick enough never to bound the call. ``(ms, None)``,
    or ``(None, why)`` where the call cannot be captured (a host sync inside it)."""
    def call():
        with torch.set_grad_enabled(backward):
            o = f()
            if backward:
                o.backward(do)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            for _ in range(2):
                for x in grads:
                    x.grad = None
                call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for x in grads:  # (the gradients are allocated inside the capture, written again by each replay)
            x.grad = None
        with torch.cuda.graph(graph):
            call()
        graph.replay()
        torch.cuda.synchronize()
        means = []
        for _ in range(rounds):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(n):
                graph.replay()
            b.record()
            b.synchronize()
            means.append(a.elapsed_time(b) / n)
        return sorted(means)[len(means) // 2], None
    except Exception as e:  # noqa: BLE001 - a peer that cannot be captured gets a note, not the end of the table
        return None, f"{type(e).__name__}: {one_line(e)}"
    finally:
        del graph
        for x in grads:
            x.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def graphed(shapes, peers, specs=None):
    """GPU-bound times side by side (:func:`graph_ms`): at every shape, forward and forward +
    backward of gdn (under each launch variant of ``specs``, a JSON list of partial
    gdn.ops.tuning.update arguments, default the tables as they are) and of each other peer of
    ``peers`` (FlashQLA at K = V = 128 only), ms, with each gdn variant's speed-up over each peer.
    The wall times of :func:`rows` are bounded by the host where its time per call exceeds the
    kernels' (a slow host, a small shape); these are not."""
    import copy

    from gdn.ops import tuning

    saved = copy.deepcopy(tuning.TABLES)
    specs = specs or [{}]
    print("\nGPU-bound ms (each call captured in a CUDA graph and replayed back to back):")
    print("| shape | pass | implementation | ms | speed-ups of this gdn variant |")
    print("|---|---|---|---|---|")
    for label, B, T, H, HV, lens, *vd in shapes:
        V = vd[0] if vd else D
        xs, cu = inputs(B, T, H, HV, lens, V)
        do = torch.randn(B, T, HV, V, device="cuda", dtype=IO)
        for bwd in (False, True):
            pas = "fwd+bwd" if bwd else "fwd"
            peer_ms = {}
            for p, name in (("fla", "FLA"), ("qla", "FlashQLA")):
                if p not in peers or (p == "qla" and (not qla_supported(D, V) or isinstance(qla_module(), str))):
                    continue
                try:
                    f = peer_call(p, xs, cu, None)[0]
                except Exception as e:  # noqa: BLE001 - a missing peer gets a note
                    print(f"| {label} | {pas} | {name} | n/a | {one_line(e)} |", flush=True)
                    continue
                ms, why = graph_ms(f, bwd, do, xs)
                print(f"| {label} | {pas} | {name} | {f'{ms:.3f}' if ms else 'n/a'} | {why or ''} |", flush=True)
                if ms:
                    peer_ms[name] = ms
            if "gdn" not in peers:
                continue
            for spec in specs:
                tuning.restore(saved)
                tuning.update(spec)
                ms, why = graph_ms(gdn_fn(xs, cu), bwd, do, xs)
                tag = "gdn" + (f" {json.dumps(spec)}" if spec else "")
                ups = ", ".join(f"{p_ms / ms:.2f}x {p}" for p, p_ms in peer_ms.items()) if ms else (why or "")
                print(f"| {label} | {pas} | {tag} | {f'{ms:.3f}' if ms else 'n/a'} | {ups} |", flush=True)
            tuning.restore(saved)
        del xs, do
        torch.cuda.empty_cache()


def _profiled(run, activity, n):
    """torch.profiler's events of n calls of ``run`` (``activity`` CPU or CUDA), after two warm-up calls."""
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(n):
            run()
        torch.cuda.synchronize()
    return prof.key_averages()


def kernel_events(run, n=5):
    """(the CUDA kernels of ``run`` from torch.profiler, longest total first; their µs per call):
    two warm-up calls, then n profiled ones."""
    evs = [e for e in _profiled(run, torch.profiler.ProfilerActivity.CUDA, n)
           if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: -e.device_time_total)
    return evs, sum(e.device_time_total for e in evs) / n


def fresh_fwd_bwd(f, leaves, do):
    """One forward + backward of ``f`` with the gradients of ``leaves`` dropped first, as the timings
    do: no call adds into the previous call's gradients (whose add kernels a profile would count)."""
    def run():
        for x in leaves:
            x.grad = None
        f().backward(do)
    return run


def kernel_times(run, label, n=5, top=14):
    """Print the per-kernel GPU time (µs per call of ``run``, torch.profiler, mean of n calls)."""
    evs, total = kernel_events(run, n)
    print(f"\n{label}, µs per call (total {total:.0f} µs):")
    for e in evs[:top]:
        print(f"  {e.device_time_total / n:9.1f}  x{e.count // n:<3d} {e.key[:90]}")


def host_ms(run, n=10):
    """Host milliseconds per call of ``run``, the GPU held by a sleep kernel meanwhile so that the
    host never waits for it (one warm-up call first). A wall time near this, above the kernels' sum,
    means the call is host-bound. An upper bound: on the H200's host a launch costs more host time
    the more launches wait queued behind the sleep (23 µs with few, up to 180 with about a thousand),
    so n is kept small; calls run back to back, where the GPU keeps the queue short, cost less."""
    run()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e9))  # ≈ 2 s of GPU cycles: longer than n calls take on the host
    t = time.perf_counter()
    for _ in range(n):
        run()
    ms = (time.perf_counter() - t) / n * 1e3
    torch.cuda.synchronize()
    return ms


def host_times(run, label, n=5, top=12):
    """Print where ``run``'s host time goes: torch.profiler's CPU events, by their own time per call
    (the launches show as cuLaunchKernel / cudaLaunchKernel, torch's ops as aten::…)."""
    evs = sorted(_profiled(run, torch.profiler.ProfilerActivity.CPU, n), key=lambda e: -e.self_cpu_time_total)
    print(f"\n{label}, host µs per call by own time (count per call):")
    for e in evs[:top]:
        print(f"  {e.self_cpu_time_total / n:9.1f}  x{e.count / n:<5.1f} {e.key[:90]}")


def profile(shapes=None, peers=("gdn", "fla")):
    """Per-kernel GPU time (µs per call) of one fwd+bwd at every shape, gdn, FLA and FlashQLA (those
    of ``peers`` present; FlashQLA at K = V = 128 only), from torch.profiler, and each call's host
    time (:func:`host_ms`): the kernels' sum against the host's says which bounds the wall time."""
    for label, B, T, H, HV, lens, *vd in SHAPES if shapes is None else shapes:
        V = vd[0] if vd else D
        xs, cu = inputs(B, T, H, HV, lens, V)
        do = torch.randn(B, T, HV, V, device="cuda", dtype=IO)
        qla = "qla" in peers and qla_supported(D, V) and not isinstance(qla_module(), str)
        fns = (("gdn", gdn_fn(xs, cu) if "gdn" in peers else None),
               ("FLA", fla_fn(xs, cu) if "fla" in peers else None),
               ("FlashQLA", qla_fn(xs, cu) if qla else None))
        for name, f in fns:
            if f is not None:
                run = fresh_fwd_bwd(f, xs, do)
                kernel_times(run, f"{name} kernels at {label}, fwd+bwd", top=18)
                print(f"  {name} host {host_ms(run) * 1e3:.0f} µs a call")


def main():
    import importlib.util

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default=",".join(PEERS), metavar="P,Q",
                    help=f"the implementations to time, of {','.join(PEERS)} (default all): gdn, FLA's Triton path, "
                         "FlashQLA, PyTorch SDPA")
    ap.add_argument("--shapes", default=None, metavar="I,J",
                    help="only these rows of the shape list, in this order (0-based indices, comma-separated; "
                         f"default {','.join(map(str, DEFAULT_ORDER))})")
    ap.add_argument("--qla-shapes", default=None, metavar="I,J",
                    help="FlashQLA only at these rows (default every row with K = V = 128)")
    ap.add_argument("--max-compile-s", type=float, default=210,
                    help="seconds FlashQLA's cells may take together, its compilation included: once spent, its "
                         "remaining cells are skipped (default 210)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows measured as JSON, after every row")
    ap.add_argument("--fla-tilelang", action="store_true",
                    help="let FLA run its TileLang kernels where it would (default FLA_TILELANG=0: FLA's Triton path)")
    ap.add_argument("--decode", action="store_true", help="also the decode rows of benchmarks/decode_gpu.py")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel times at every shape (torch.profiler); with --variants also host time per call")
    ap.add_argument("--only-profile", action="store_true", help="only the per-kernel profile")
    ap.add_argument("--graph", action="store_true",
                    help="only GPU-bound times: each peer's call captured in a CUDA graph and replayed (no host "
                         "time in them), gdn under each --variants entry")
    ap.add_argument("--variants", default=None, metavar="JSON|FILE",
                    help="only gdn, timed under each of a JSON list of partial launch configurations (inline, or "
                         "a file holding it)")
    ap.add_argument("--config", default=None, metavar="FILE|JSON",
                    help="launch configurations to use: a JSON file (tools/tune_gpu.py --out) or an inline "
                         "partial configuration such as '{\"split\": {\"L\": -1}}' (gdn.ops.tuning.update_from)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                    help="dtype of q, k, v and dO (g and beta stay fp32; SDPA's reference stays bf16)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="start no new shape after this many seconds (the table and what was measured still print)")
    args = ap.parse_args()
    try:
        peers = parse_peers(args.peers)
        order = parse_indices(args.shapes, len(SHAPES)) if args.shapes else list(DEFAULT_ORDER)
        qla_rows = None if args.qla_shapes is None else parse_indices(args.qla_shapes, len(SHAPES))
    except ValueError as e:
        ap.error(str(e))
    specs = None
    if args.variants:
        from gdn.ops.tuning import read_json

        try:  # a JSON list, or a file holding one (for scripts that pass their flags as words)
            specs = read_json(args.variants)
        except (OSError, ValueError) as e:
            ap.error(f"--variants: expected a JSON list of partial launch configurations or a file holding one: {e}")
        if not isinstance(specs, list) or not all(isinstance(x, dict) for x in specs):
            ap.error("--variants: expected a JSON list of objects, e.g. '[{}, {\"split\": {\"L\": -1}}]'")
    fla_backends(args.fla_tilelang)
    global IO
    IO = DTYPES[args.dtype]
    shapes = [SHAPES[i] for i in order]
    if args.config:
        from gdn.ops import tuning

        tuning.apply_config(ap, args.config)
        print("launch configuration overrides:", args.config)
    if args.graph:
        graphed(shapes, peers, specs)
        return
    if args.variants:
        variants(specs, args.profile, shapes)
        if not args.only_profile:
            return
    if args.only_profile:
        profile(shapes, peers)
        return
    start = time.monotonic()
    deadline = start + args.max_seconds if args.max_seconds else float("inf")
    # a `timeout` (SIGTERM) still prints the table of the rows measured so far
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rs, rates = [], [float("nan"), float("nan")]
    meta = {"argv": sys.argv[1:], "date": str(datetime.date.today()), "peers": peers, "order": order,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None, **versions(),
            "dtype": args.dtype, "FLA_FLASH_QLA": os.environ.get("FLA_FLASH_QLA"), "FLA_TILELANG": os.environ.get("FLA_TILELANG")}

    def on_row(_):
        if args.json:
            write_json(args.json, {**meta, "mm_flops": rates[0], "copy_Bps": rates[1],
                                   "elapsed_s": time.monotonic() - start}, rs)
    try:
        rows(rs, rates, deadline, order=order, peers=peers, qla_rows=qla_rows, max_compile_s=args.max_compile_s,
             on_row=on_row)
    finally:
        table(rs, *rates, peers)
        print(f"run took {time.monotonic() - start:.0f} s", flush=True)
    if args.profile and time.monotonic() < deadline:
        profile(shapes, peers)
    dec = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_gpu.py")
    if args.decode and os.path.exists(dec):
        spec = importlib.util.spec_from_file_location("decode_gpu", dec)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        print()
        print(mod.markdown(mod.rows(rates[1])))


if __name__ == "__main__":
    main()
