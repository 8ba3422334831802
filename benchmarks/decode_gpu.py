"""Decode benchmark on the GPU: one token per sequence, gdn's fused recurrent kernel vs FLA 0.6.0.

Shape: B ∈ {1, 32, 256} sequences, H = 16 q/k heads, HV = 32 value heads, K = V = 128, bf16
q/k/v/o, fp32 g/beta and fp32 state (Gated DeltaNet). Per row:

- gdn: :func:`fused_recurrent_gated_delta_rule_pool`, the state updated in place in a pool.
- FLA: ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule`` with initial_state and
  output_final_state (its decode path).
- Each timed two ways: through Python (``triton.testing.do_bench`` median of single launches, so
  at small B mostly host launch overhead) and as GPU time per step of a CUDA graph holding 100
  consecutive steps (what a captured model sees); plus the replay of a one-step
  :class:`DecodeGraph` timed from the host.

Bytes counted (the floor): state read + written once (fp32), q, k, v, o once (bf16), g, beta once
(fp32). GB/s is against a device-to-device copy measured in the same run (bytes read + written).

    python benchmarks/decode_gpu.py [--sweep] [--prefill]   # markdown table (+ tile sweep, + short prefills)

``rows()`` returns the rows as dicts (for benchmarks/ops_gpu.py).
"""
from __future__ import annotations

import argparse
import datetime

import torch
import triton
from triton.testing import do_bench

from gdn.ops.delta.triton import pool as RP
from gdn.ops.delta.triton import recurrent as FR

H, HV, K, V = 16, 32, 128, 128
BATCHES = (1, 32, 256)
GRAPH_STEPS = 100
SWEEP = [(8, 1), (16, 1), (16, 4), (32, 1), (32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8)]


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second (B/s)."""
    x = torch.empty(2**29, dtype=torch.float32, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=500, return_mode="median")
    return 2 * x.numel() * 4 / (ms * 1e-3)


def decode_bytes(B: int) -> int:
    state = B * HV * K * V * 4 * 2
    return state + B * (2 * H * K * 2 + 2 * HV * V * 2 + 2 * HV * 4)


def make(B, pool_size=None):
    """Decode inputs for B sequences (rotating pools so B = 256 does not sit in L2)."""
    P = pool_size or B
    q = torch.randn(B, 1, H, K, device="cuda", dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, 1, H, K, device="cuda"), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, 1, HV, V, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(B, 1, HV, device="cuda") * 0.1
    beta = torch.rand(B, 1, HV, device="cuda")
    pool = torch.randn(P, HV, K, V, device="cuda") * 0.1
    slots = torch.randperm(P, device="cuda")[:B].to(torch.int32)
    return q, k, v, g, beta, pool, slots


def per_step_in_graph_us(fns) -> float:
    """GPU µs per call of a CUDA graph holding GRAPH_STEPS calls, cycling through ``fns``."""
    with torch.inference_mode():
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(GRAPH_STEPS):
                fns[i % len(fns)]()
    return do_bench(graph.replay, warmup=20, rep=200, return_mode="median") * 1e3 / GRAPH_STEPS


def one_step_replay_us(B) -> float:
    """µs of one replay of a one-step :class:`DecodeGraph` (timed from the host: launch included)."""
    q, k, v, g, beta, pool, slots = make(B)
    dg = RP.DecodeGraph(pool, B, H, dtype=torch.bfloat16)
    dg(q, k, v, g, beta, slot_indices=slots)
    return do_bench(dg.replay, warmup=20, rep=200, return_mode="median") * 1e3


def prefill_rows(lengths=(1, 4, 16, 64, 256), batches=(1, 8)) -> list[dict]:
    """Short prefills, no grad: the token-recurrent kernel vs the chunk kernels
    (:func:`gdn.ops.delta.triton.chunk.chunk_op`), to place the T below which the recurrent kernel
    wins (:data:`gdn.ops.tuning.RECURRENT_MAX_T`). bf16, H=16, HV=32, K=V=128, fp32 state."""
    from gdn.ops.delta.triton.chunk import chunk_op
    out = []
    for B in batches:
        for T in lengths:
            q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
            k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(torch.bfloat16)
            v = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
            g = -torch.rand(B, T, HV, device="cuda") * 0.1
            beta = torch.rand(B, T, HV, device="cuda")
            h0 = torch.randn(B, HV, K, V, device="cuda") * 0.1
            with torch.inference_mode():
                rec = do_bench(lambda: FR.fused_recurrent_gated_delta_rule(
                    q, k, v, g, beta, initial_state=h0, output_final_state=True), warmup=10, rep=100,
                    return_mode="median")
                chk = do_bench(lambda: chunk_op(q, k, v, g, beta, initial_state=h0, output_final_state=True),
                               warmup=10, rep=100, return_mode="median")
            out.append({"B": B, "T": T, "recurrent_us": rec * 1e3, "chunk_us": chk * 1e3})
    return out


def fla_fn(q, k, v, g, beta, h0):
    """FLA 0.6.0's decode call (state in, new state out), or None when fla is not installed."""
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fr
    except ImportError:
        return None
    return lambda: fla_fr(q, k, v, g, beta, initial_state=h0, output_final_state=True)


def _bench_sets(B):
    """(rotation, gdn calls, FLA calls or [None]) at batch B: state sets rotated when they would sit in L2."""
    rot = 4 if B * HV * K * V * 4 < 256 * 2**20 else 1
    sets = [make(B) for _ in range(rot)]
    gdn = [lambda s=s: RP.fused_recurrent_gated_delta_rule_pool(*s[:5], state_pool=s[5], slot_indices=s[6])
           for s in sets]
    fla = [fla_fn(*s[:5], s[5][s[6].long()].contiguous()) for s in sets]
    return rot, gdn, fla


def _python_us(fns, rot) -> float:
    it = iter(range(10**9))
    with torch.inference_mode():
        return do_bench(lambda: fns[next(it) % rot](), warmup=25, rep=200, return_mode="median") * 1e3


def rows(copy_bw: float | None = None) -> list[dict]:
    """Decode rows (one dict per B): µs through Python (do_bench) and per step inside a CUDA graph
    of 100 steps, for gdn (pool, in place) and FLA; gdn one-step graph replay; GB/s and % of the
    measured copy bandwidth from the in-graph GPU times; speed-up over FLA (in-graph).

    gdn's rows are measured first for every B, FLA's after: a fault in the peer (an illegal memory
    access poisons the CUDA context for the rest of the process) then costs only FLA's columns
    (NaN), not gdn's."""
    torch.manual_seed(0)
    copy_bw = copy_bw or copy_bandwidth()
    out = []
    for B in BATCHES:
        rot, gdn, _ = _bench_sets(B)
        gdn_step = per_step_in_graph_us(gdn)
        nbytes = decode_bytes(B)
        out.append({
            "B": B, "bytes_MB": nbytes / 1e6, "gdn_us": _python_us(gdn, rot), "gdn_graph_step_us": gdn_step,
            "gdn_graph_replay_us": one_step_replay_us(B), "gdn_GBps": nbytes / (gdn_step * 1e-6) / 1e9,
            "gdn_pct_copy": 100 * nbytes / (gdn_step * 1e-6) / copy_bw, "copy_GBps": copy_bw / 1e9,
            "fla_us": float("nan"), "fla_graph_step_us": float("nan"), "fla_GBps": float("nan"),
            "fla_pct_copy": float("nan"), "speedup_vs_fla": float("nan"),
        })
        del gdn
    for r in out:
        try:
            rot, _, fla = _bench_sets(r["B"])
            if fla[0] is None:
                break
            r["fla_us"] = _python_us(fla, rot)
            try:
                r["fla_graph_step_us"] = per_step_in_graph_us(fla)
            except Exception as e:  # noqa: BLE001 - report and fall back to FLA's Python-launched time
                print(f"FLA graph capture failed at B={r['B']}: {type(e).__name__}: {e}")
            fla_gpu = r["fla_graph_step_us"] if r["fla_graph_step_us"] == r["fla_graph_step_us"] else r["fla_us"]
            nbytes = decode_bytes(r["B"])
            r["fla_GBps"] = nbytes / (fla_gpu * 1e-6) / 1e9
            r["fla_pct_copy"] = 100 * nbytes / (fla_gpu * 1e-6) / copy_bw
            r["speedup_vs_fla"] = fla_gpu / r["gdn_graph_step_us"]
        except Exception as e:  # noqa: BLE001 - the peer failed: keep gdn's rows, say so
            print(f"FLA decode failed at B={r['B']}: {type(e).__name__}: {str(e)[:200]}; FLA columns left empty")
            break
    return out


def sweep(B) -> list[tuple]:
    """Time each (BV, num_warps) tile choice of the kernel at batch B (µs, do_bench median)."""
    q, k, v, g, beta, pool, slots = make(B)
    o = torch.empty(B, 1, HV, V, dtype=torch.bfloat16, device="cuda")
    res = []
    for BV, warps in SWEEP:
        def fn(BV=BV, warps=warps):
            FR.launch(q, k, v, g, beta, o, pool, pool, scale=K ** -0.5, slots=slots, pool_size=pool.shape[0],
                      store_ht=True, num_sequences=B, tiles=(BV, warps))
        with torch.inference_mode():
            fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    fn()
        res.append((BV, warps, do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3 / 20))
    return res


def markdown(rs) -> str:
    lines = [
        f"Decode, one token, Gated DeltaNet, H={H} HV={HV} K=V={K}, bf16 q/k/v/o, fp32 g/beta/state. "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.date.today()}; copy bandwidth measured {rs[0]['copy_GBps']:.0f} GB/s.",
        "",
        "| B | bytes (MB) | gdn via Python (µs) | FLA via Python (µs) | gdn in graph, per step (µs) "
        "| FLA in graph, per step (µs) | gdn 1-step graph replay (µs) | gdn GB/s (% copy) | FLA GB/s (% copy) "
        "| speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        lines.append(
            f"| {r['B']} | {r['bytes_MB']:.1f} | {r['gdn_us']:.1f} | {r['fla_us']:.1f} | "
            f"{r['gdn_graph_step_us']:.2f} | {r['fla_graph_step_us']:.2f} | {r['gdn_graph_replay_us']:.1f} | "
            f"{r['gdn_GBps']:.0f} ({r['gdn_pct_copy']:.0f}%) | {r['fla_GBps']:.0f} ({r['fla_pct_copy']:.0f}%) | "
            f"{r['speedup_vs_fla']:.1f}× |")
    lines += ["", "Python: do_bench median of single launches (includes host launch overhead). In graph: GPU time "
              f"per step of a CUDA graph of {GRAPH_STEPS} consecutive steps (state sets rotated when they fit in L2); "
              "GB/s and speed-up use these. 1-step replay: do_bench of DecodeGraph.replay()."]
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time every (BV, num_warps) tile choice")
    ap.add_argument("--prefill", action="store_true", help="also time short prefills: recurrent vs chunk kernels")
    args = ap.parse_args()
    if args.sweep:
        for B in BATCHES:
            for BV, warps, us in sweep(B):
                print(f"sweep B={B} BV={BV} warps={warps}: {us:.2f} us")
    if args.prefill:
        print("| B | T | fused recurrent (µs) | chunk kernels (µs) |\n|---|---|---|---|")
        for r in prefill_rows():
            print(f"| {r['B']} | {r['T']} | {r['recurrent_us']:.1f} | {r['chunk_us']:.1f} |")
    print(markdown(rows()))
