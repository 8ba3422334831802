"""Sweep the decode products' streaming kernel (gdn/ops/triton/gemv.py) on a GPU: for each product of
a model's decode step at one to four rows, the time and bandwidth of each (BN, BK, warps) candidate
next to cuBLAS (``F.linear``) and the configured choice (``OTHER["gemv"]``).

    python tools/tune_gemv.py [--preset gdn --size 340m] [--rows 1,4] [--json out.json]

The products are the decode step's: each layer kind's joined input projection, its output
projection, the MLP's joined gate and up projection and its down projection (with SwiGLU formed
inside). Times are ``triton.testing.do_bench`` medians with the L2 flushed between calls, so each
call reads its weight from HBM as the decode step does.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gdn.checkpoint import atomic_write_text  # noqa: E402
from gdn.models import GDNConfig, GDNForCausalLM  # noqa: E402


def products(model) -> list[tuple[str, int, int, bool]]:
    """(name, N, K, SwiGLU form) of each distinct decode product of ``model``."""
    out, seen = [], set()
    for block in model.model.layers:
        mixer_w, mlp_w = block.decode_weights()
        joined = block.mixer.decode_input(mixer_w)
        o = block.mixer.o_proj.weight
        down = block.mlp.down_proj.weight
        for name, w, glu in ((f"{type(block.mixer).__name__} input", joined.weight, False),
                             (f"{type(block.mixer).__name__} output", o, False),
                             ("MLP gate+up", mlp_w.weight, False), ("MLP down (SwiGLU)", down, True)):
            key = (tuple(w.shape), glu)
            if key not in seen:
                seen.add(key)
                out.append((name, w.shape[0], w.shape[1], glu))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gdn")
    p.add_argument("--size", default="340m")
    p.add_argument("--rows", default="1,4", help="comma-separated row counts (at most 4)")
    p.add_argument("--json", default=None, help="also write the rows as JSON")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_gemv needs a CUDA device", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from gdn.ops.triton import gemv as G

    model = GDNForCausalLM(GDNConfig.from_preset(a.preset, a.size)).to("cuda", torch.bfloat16).eval()
    rows = [int(r) for r in a.rows.split(",") if r.strip()]
    results = []
    print(f"{a.preset} {a.size}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; µs (GB/s)")
    for (name, N, K, glu), M in itertools.product(products(model), rows):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, 1, K, device="cuda", dtype=torch.bfloat16)
        u = torch.randn(M, 1, K, device="cuda", dtype=torch.bfloat16) if glu else None
        nbytes = w.numel() * 2

        def cublas():
            return F.linear(F.silu(x) * u if glu else x, w)

        t_ref = do_bench(cublas, return_mode="median") * 1e3
        t_cfg = do_bench(lambda: G.gemv(x, w, u), return_mode="median") * 1e3
        best = (t_cfg, G.tiles(N, K, x.device), None)
        for BN, elems, warps in itertools.product((1, 2, 4, 8, 16, 32), (2048, 4096, 8192), (2, 4, 8)):
            BK = max(64, min(elems // BN, triton.next_power_of_2(K)))
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            x2, u2 = x.reshape(M, K), (x if u is None else u).reshape(M, K)

            def run():
                G._gemv_kernel[(triton.cdiv(N, BN),)](x2, u2, w, y, w, y, M, N, K, K, N, N, 0.0, K=K,
                                                      BM=triton.next_power_of_2(M), BN=BN, BK=BK,
                                                      FORM=1 if glu else 0, HAS_U=glu, num_warps=warps)
            try:
                t = do_bench(run, return_mode="median") * 1e3
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile is skipped
                print(f"  skip BN={BN} BK={BK} warps={warps}: {type(e).__name__}")
                continue
            if t < best[0]:
                best = (t, (BN, BK), warps)
        row = dict(product=name, N=N, K=K, rows=M, cublas_us=t_ref, configured_us=t_cfg, best_us=best[0],
                   best=dict(BN=best[1][0], BK=best[1][1], warps=best[2]), MB=nbytes / 1e6)
        results.append(row)
        print(f"{name:22s} N={N:6d} K={K:5d} M={M}: cuBLAS {t_ref:6.2f} ({nbytes / t_ref / 1e3:5.0f}), "
              f"configured {t_cfg:6.2f} ({nbytes / t_cfg / 1e3:5.0f}), best {best[0]:6.2f} "
              f"({nbytes / best[0] / 1e3:5.0f}) at BN={best[1][0]} BK={best[1][1]} warps={best[2]}")
    if a.json:
        atomic_write_text(Path(a.json), json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
