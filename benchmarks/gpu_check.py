"""GPU proof of correctness of the Triton chunk kernels (DESIGN §5 tier 3), run on the H200.

For every member, at the awkward shapes of DESIGN §5 and at the benchmark shapes, in fp32 and
bf16, the Triton backend's output, final state and every gradient (q, k, v, g, beta, initial
state; through o and the final state) are compared with a float64 chunk-backend reference on
the fp32 inputs as drawn:

- fp32: relative RMS error ≤ 2e-3;
- bf16: the inputs are rounded to bf16 and given to the Triton kernels and to the PyTorch chunk
  backend (which computes in fp32 from them); the Triton error against the fp64 reference must be
  ≤ 2 × the chunk backend's. The bf16 budget is thus what bf16 inputs cost anyway (DESIGN §5
  tier 3: "against the same fp32 reference"), which leaves room for bf16 intermediates.

Prints one table row per (case, dtype) and exits non-zero if anything fails. If the decode
kernels and ``benchmarks/gpu_check_decode.py`` exist, their ``main()`` runs too.

Usage: ``python benchmarks/gpu_check.py [--quick]``
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn import ops  # noqa: E402
from gdn.ops import chunk as chunk_ops  # noqa: E402

MEMBERS = ("gated_delta_rule", "delta_rule", "gated_linear_attention", "linear_attention")
HAS_G = {"linear_attention": False, "gated_linear_attention": True, "delta_rule": False, "gated_delta_rule": True}
HAS_BETA = {"linear_attention": False, "gated_linear_attention": False, "delta_rule": True, "gated_delta_rule": True}
FP32_TOL = 2e-3


def rel(x, ref):
    if x is None or ref is None:
        return float("nan") if (x is None) != (ref is None) else 0.0
    x, ref = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def make(B, T, H, HV, K, V, lens, member, state, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"

    def r(*s):
        return torch.randn(*s, generator=gen, device=dev)

    N = len(lens) if lens else B
    d = {
        "q": r(B, T, H, K),
        "k": torch.nn.functional.normalize(r(B, T, H, K), dim=-1),
        "v": r(B, T, HV, V),
        "g": torch.nn.functional.logsigmoid(r(B, T, HV) + 3.0) if HAS_G[member] else None,
        "beta": torch.sigmoid(r(B, T, HV)) if HAS_BETA[member] else None,
        "initial_state": r(N, HV, K, V) * 0.3 if state else None,
    }
    d = {n: (None if x is None else x.double()) for n, x in d.items()}
    cu = None
    if lens:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # on the CPU
    return d, cu


def run(fn, member, d, dtype, cu, do, dS):
    def leaf(n, x):
        dt = dtype if n != "initial_state" or dtype == torch.float64 else torch.float32
        return x.detach().to(dt).clone().requires_grad_(True)

    xs = {n: (None if x is None else leaf(n, x)) for n, x in d.items()}
    args = [xs["q"], xs["k"], xs["v"]] + [xs[n] for n in ("g", "beta") if xs[n] is not None]
    o, S = fn(*args, initial_state=xs["initial_state"], output_final_state=True, cu_seqlens=cu)
    loss = (o.double() * do).sum() + (S.double() * dS).sum()
    loss.backward()
    out = {"o": o.detach(), "S": S.detach()}
    for n, x in xs.items():
        if x is not None:
            out["d" + n if n != "initial_state" else "dh0"] = x.grad
    return out


def check_case(name, member, B, T, H, HV, K, V, lens=None, state=True, seed=0):
    d, cu = make(B, T, H, HV, K, V, lens, member, state, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    N = len(lens) if lens else B
    do = torch.randn(B, T, HV, V, generator=gen, device="cuda", dtype=torch.float64)
    dS = torch.randn(N, HV, K, V, generator=gen, device="cuda", dtype=torch.float64)
    ref_fn = getattr(chunk_ops, member)
    tri_fn = getattr(ops, member)

    def tri(*a, **kw):
        return tri_fn(*a, backend="triton", **kw)

    ref = run(ref_fn, member, d, torch.float64, cu, do, dS)
    rows, ok_all = [], True
    for dtype in (torch.float32, torch.bfloat16):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = run(tri, member, d, dtype, cu, do, dS)
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        errs = {k: rel(got[k], ref[k]) for k in ref}
        if dtype == torch.float32:
            bounds = {k: FP32_TOL for k in ref}
        else:
            base = run(ref_fn, member, d, dtype, cu, do, dS)
            bounds = {k: 2 * rel(base[k], ref[k]) for k in ref}
        ok = all(errs[k] <= bounds[k] for k in ref)
        ok_all &= ok
        worst = max(ref, key=lambda k: errs[k] / max(bounds[k], 1e-30))
        rows.append(f"| {name} | {member} | {str(dtype)[6:]} | {secs:.2f} | "
                    + " ".join(f"{k}={errs[k]:.1e}" for k in ref)
                    + f" | {worst}: {errs[worst]:.1e} ≤ {bounds[worst]:.1e} | {'ok' if ok else 'FAIL'} |")
    return rows, ok_all


# The default run (what fits a short lease): every awkward K/V for gated_delta_rule, the other
# members at one awkward and one benchmark shape, every benchmark shape; --full: every member
# at every awkward shape.
def check_fused(B, T, H, HV, K, V, seed=99, draws=4):
    """gdn.ops.fused.gated_delta_rule_fused: Triton prologue + kernels vs the PyTorch prologue and
    the float64 chunk backend; every gradient including a, b, A_log, dt_bias. dA_log and dt_bias
    have HV entries each, so one draw's relative error is a sample of a handful of numbers: errors
    are pooled over ``draws`` independent draws (‖x − ref‖² and ‖ref‖² summed over draws) for the
    Triton path and the bf16 chunk backend alike."""
    from gdn.ops.fused import gated_delta_rule_fused

    params = ("A_log", "dt_bias", "initial_state")
    acc: dict = {}  # (path, key) -> [Σ‖x − ref‖², Σ‖ref‖²]

    def add(path, got, ref):
        for k in ref:
            x, r = got[k].detach().double(), ref[k].detach().double()
            e = acc.setdefault((path, k), [0.0, 0.0])
            e[0] += float((x - r).norm() ** 2) if torch.isfinite(x).all() else float("inf")
            e[1] += float(r.norm() ** 2)

    for draw in range(draws):
        gen = torch.Generator(device="cuda").manual_seed(seed + 1000 * draw)

        def r(*s):
            return torch.randn(*s, generator=gen, device="cuda").double()

        d = {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, HV, V), "a": r(B, T, HV), "b": r(B, T, HV),
             "A_log": r(HV) * 0.5, "dt_bias": r(HV) * 0.5, "initial_state": r(B, HV, K, V) * 0.3}
        do = torch.randn(B, T, HV, V, generator=gen, device="cuda", dtype=torch.float64)
        dS = torch.randn(B, HV, K, V, generator=gen, device="cuda", dtype=torch.float64)

        def go(dtype, backend):
            xs = {n: x.detach().to(torch.float32 if n in params and dtype != torch.float64 else dtype).clone()
                  .requires_grad_(True) for n, x in d.items()}
            o, S = gated_delta_rule_fused(*[xs[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")],
                                          initial_state=xs["initial_state"], output_final_state=True, backend=backend)
            ((o.double() * do).sum() + (S.double() * dS).sum()).backward()
            return {"o": o, "S": S, **{"d" + n: x.grad for n, x in xs.items()}}

        ref = go(torch.float64, "chunk")
        add("fp32", go(torch.float32, "triton"), ref)
        add("bf16", go(torch.bfloat16, "triton"), ref)
        add("bf16 chunk", go(torch.bfloat16, "chunk"), ref)
    keys = [k for (p, k) in acc if p == "fp32"]

    def err(path, k):
        num, den = acc[(path, k)]
        return (num / max(den, 1e-300)) ** 0.5

    rows, ok_all = [], True
    for path, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        errs = {k: err(path, k) for k in keys}
        bounds = {k: FP32_TOL if path == "fp32" else 2 * err("bf16 chunk", k) for k in keys}
        ok = all(errs[k] <= bounds[k] for k in keys)
        ok_all &= ok
        worst = max(keys, key=lambda k: errs[k] / max(bounds[k], 1e-30))
        rows.append(f"| fused prologue B={B} T={T} H={H} HV={HV} K={K} V={V} ({draws} draws pooled) | "
                    f"gated_delta_rule_fused | {dtype} | - | " + " ".join(f"{k}={errs[k]:.1e}" for k in keys)
                    + f" | {worst}: {errs[worst]:.1e} ≤ {bounds[worst]:.1e} | {'ok' if ok else 'FAIL'} |")
    return rows, ok_all


AWKWARD = [
    # name, B, T, H, HV, K, V, lens, state
    ("T=1", 2, 1, 2, 4, 16, 60, None, True),
    ("T=63", 2, 63, 2, 4, 60, 16, None, True),
    ("T=65", 1, 65, 2, 4, 64, 100, None, True),
    ("T=300 K=V=128", 2, 300, 2, 2, 128, 128, None, True),
    ("T=300 K=100 V=64", 1, 300, 1, 2, 100, 64, None, False),
    ("K=V=256", 1, 200, 1, 1, 256, 256, None, True),
    ("packed", 1, 360, 2, 4, 64, 64, [65, 1, 0, 63, 128, 103], True),
]
BENCH = [
    ("(8,2048,16,128)", 8, 2048, 16, 16, 128, 128, None, False),
    ("(4,8192,16,128)", 4, 8192, 16, 16, 128, 128, None, False),
    ("(1,32768,16,128)", 1, 32768, 16, 16, 128, 128, None, False),
    ("(1,8192,16,HV=32,128)", 1, 8192, 16, 32, 128, 128, None, True),
    ("packed 12 seqs / 32768", 1, 32768, 16, 16, 128, 128,
     [4096, 1000, 7000, 300, 2048, 5000, 64, 3000, 1500, 4260, 2500, 2000], True),
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="awkward shapes and the smallest benchmark shape only")
    p.add_argument("--full", action="store_true", help="every member at every awkward shape")
    p.add_argument("--shard", default="0/1", help="i/n: run every n-th case from the i-th (parallel processes)")
    p.add_argument("--no-decode", action="store_true", help="skip benchmarks/gpu_check_decode.py")
    p.add_argument("--split", type=int, default=None,
                   help="segment length in chunks of the split state passes (CONFIG['split']['L']: 0 off, -1 auto)")
    p.add_argument("--config", default=None, metavar="FILE|JSON",
                   help='partial launch configuration to check: a JSON file or inline JSON, e.g. '
                        '\'{"kkt_solve": {"INV": "tf32"}}\'')
    a = p.parse_args(argv)
    if a.config:
        from gdn.ops.triton._common import update_config_from

        update_config_from(a.config)
        print(f"launch configuration overrides: {a.config}")
    if a.split is not None:
        from gdn.ops.triton._common import CONFIG

        CONFIG["split"]["L"] = a.split
        print(f"split state passes: L = {a.split}")
    si, sn = (int(x) for x in a.shard.split("/"))
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {__import__('triton').__version__}")
    print("| case | member | dtype | first call s | rel. RMS error vs fp64 | worst / bound | |")
    print("|---|---|---|---|---|---|---|")
    ok_all = True
    if a.full:
        cases = [(c, m) for c in AWKWARD for m in MEMBERS]
    else:
        cases = [(c, "gated_delta_rule") for c in AWKWARD] + [(AWKWARD[3], m) for m in MEMBERS[1:]]
    bench = BENCH[:1] if a.quick else BENCH
    cases += [(c, "gated_delta_rule") for c in bench] + [(bench[0], m) for m in MEMBERS[1:]]
    fused = [(2, 300, 2, 4, 128, 128), (1, 65, 1, 2, 60, 100)]
    jobs = [("case", i, c) for i, c in enumerate(cases)] + [("fused", i, f) for i, f in enumerate(fused)]
    jobs = jobs[si::sn]
    for kind, i, job in jobs:
        if kind == "fused":
            try:
                rows, ok = check_fused(*job)
            except Exception as e:  # report and continue
                rows, ok = [f"| fused prologue {job} | - | - | - | {type(e).__name__}: {str(e)[:200]} | | FAIL |"], False
            ok_all &= ok
            print("\n".join(rows), flush=True)
            continue
        (name, B, T, H, HV, K, V, lens, state), member = job
        try:
            rows, ok = check_case(name, member, B, T, H, HV, K, V, lens, state, seed=i)
        except Exception as e:  # report and continue: the table is the deliverable
            rows, ok = [f"| {name} | {member} | - | - | {type(e).__name__}: {str(e)[:200]} | | FAIL |"], False
        ok_all &= ok
        print("\n".join(rows), flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    dec = os.path.join(here, "gpu_check_decode.py")
    if not a.no_decode and si == 0 and os.path.exists(dec):
        spec = importlib.util.spec_from_file_location("gpu_check_decode", dec)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        ok_all &= bool(mod.main())  # True when every decode check passes
    print("ALL OK" if ok_all else "SOME CHECKS FAILED")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
