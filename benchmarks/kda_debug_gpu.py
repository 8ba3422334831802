"""Where do the chunkwise Triton KDA kernels fault on the GPU? One case per process, blocking launches.

The first H200 check of ``gdn/ops/triton/kda_chunk*.py`` died with an illegal memory access at its
first case (T = 130, K = 100, V = 128, HV = 2H) and every later case then failed in the poisoned
context (docs/KDA.md). This script runs each check case in its own subprocess with
``CUDA_LAUNCH_BLOCKING=1``, fp32 then bf16, each the forward alone (no gradient), then forward and
backward; when a process dies (a fault poisons its CUDA context) the dtypes it had left run in a
new one. Every kernel launch is logged (name, grid, tiles) and synchronised before the next, so a
fault names its kernel. One line per (case, stage, dtype)::

    <case> | <fwd|bwd> | <dtype> | ok / FAIL / ERR | worst relative error and bound, or the exception | last launch

Errors are relative RMS errors against gdn's float64 PyTorch chunk form on the same inputs (o and
the final state for fwd; every gradient for bwd); bounds as ``benchmarks/kda_gpu.py``: fp32 ≤ 2e-3,
bf16 ≤ 2 × the error of the PyTorch chunk form given the same bf16 inputs.

The first row repeats the failing case, fp32 only, with the launch configuration of the first H200
run (state-pass V tiles halved down to 16, K and V padded to 16 only; ``--no-old`` leaves it out);
the rows after it run the current configuration. After the sweep, when a case failed, the first
failing (case, dtype) is repeated with single configuration changes (``VARIANTS``: fewer warps for
the kernels with 16-row sub-block dots, ...; ``--no-variants`` leaves them out), so one call tells
which change clears it. ``--sanitizer`` then runs the first failing case (the first-run row's if
only it failed; the first case if none did) under ``compute-sanitizer --tool memcheck`` with
PyTorch's caching allocator off and prints the first 40 lines of its report. The sanitizer's time
(``--sanitizer-seconds``) is kept out of the sweep's.

    PYTHONPATH=. python benchmarks/kda_debug_gpu.py [--max-seconds 150] [--sanitizer] [--no-variants]
        [--cases SUBSTR ...] [--config JSON]
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/kda_debug_gpu.py --dry-run   # plumbing, CPU
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

#: (name, B, T, H, HV, K, V, packed lengths or None, g scale or None): g = logsigmoid(x + 3), or
#: −s·uniform(0, 1) with a scale s (strong decay).
CASES = [
    ("T=130 K=100 V=128 H=2 HV=4", 1, 130, 2, 4, 100, 128, None, None),
    ("T=130 K=100 V=128 B=3 H=16 HV=32 (state V tile 64)", 3, 130, 16, 32, 100, 128, None, None),
    ("packed [1,200,64,0,135] K=V=128 H=2 HV=4", 1, 400, 2, 4, 128, 128, [1, 200, 64, 0, 135], None),
    ("T=63 K=60 V=60 B=2 H=1 HV=2", 2, 63, 1, 2, 60, 60, None, None),
    ("T=1 K=16 V=16 B=2 H=1 HV=2", 2, 1, 1, 2, 16, 16, None, None),
    ("T=65 K=128 V=32 H=1 HV=2 g>=-5", 1, 65, 1, 2, 128, 32, None, 5.0),
]
DRY_CASES = [("T=65 K=20 V=16 H=1 HV=2", 1, 65, 1, 2, 20, 16, None, None)]
#: The launch configuration of the first H200 run (commit 3adfe1a): state-pass V tiles halved down to
#: 16 when the programs do not fill the card, K and V padded to powers of two ≥ 16.
OLD = {"state_fwd": {"min_BV": 16}, "state_bwd": {"min_BV": 16}, "MIN_DIM": 16}
#: Single changes tried on the first failing case, those that touch the kernel launched last before
#: the failure first.
VARIANTS = [
    ("kkt 2 warps (as the scalar kkt_solve)", {"kkt": {"num_warps": 2}}),
    ("kkt 4 warps", {"kkt": {"num_warps": 4}}),
    ("kkt K tile 32", {"kkt": {"BK": 32}}),
    ("state V tiles >= 64", {"state_fwd": {"min_BV": 64}, "state_bwd": {"min_BV": 64}}),
    ("intra_bwd 4 warps", {"intra_bwd": {"num_warps": 4}}),
    ("state passes 4 warps", {"state_fwd": {"num_warps": 4}, "state_bwd": {"num_warps": 4}}),
    ("every kernel 4 warps", {n: {"num_warps": 4} for n in ("gamma", "kkt", "wu", "state_fwd", "output",
                                                           "dv_local", "state_bwd", "dqk", "wy_bwd",
                                                           "intra_bwd")}),
    ("first-run tiles (state V tiles 16)", OLD),
]
FP32_TOL = 2e-3
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


# ----------------------------------------------------------------------------------------------
# Child: one case and dtype, forward then backward
# ----------------------------------------------------------------------------------------------

def say(*parts):
    print(*parts, flush=True)


def apply_config(cfg: dict) -> None:
    """Apply ``{kernel: {key: value}, "MIN_DIM": n}`` to the KDA chunk kernels' configuration."""
    from gdn.ops.triton import kda_chunk, kda_chunk_fwd

    for name, upd in cfg.items():
        if name == "MIN_DIM":
            kda_chunk.MIN_DIM = int(upd)
        else:
            kda_chunk_fwd.CONFIG[name].update({k: tuple(v) if k == "stages" else v for k, v in upd.items()})


def log_launches(sync: bool) -> None:
    """Log every kernel launch of the KDA chunk kernels before it runs (and synchronise after it,
    so that an asynchronous fault is reported at its own kernel)."""
    import torch

    from gdn.ops.triton import _common, kda_chunk_fwd

    inner = kda_chunk_fwd._common_launch

    def logged(kernel, grid, *args, name, **kw):
        if _common._RECORD is None:
            meta = {k: v for k, v in kw.items() if k.isupper() or k == "num_warps"}
            say(f"LAUNCH {kernel.fn.__name__} grid={tuple(grid)} {json.dumps(meta, default=str)}")
        out = inner(kernel, grid, *args, name=name, **kw)
        if sync and _common._RECORD is None:
            torch.cuda.synchronize()
            if out is not None:  # the compiled kernel: registers, spills, shared memory (bytes)
                say(f"COMPILED {kernel.fn.__name__} regs={getattr(out, 'n_regs', '?')} "
                    f"spills={getattr(out, 'n_spills', '?')} shared={getattr(out.metadata, 'shared', '?')}")
        return out

    kda_chunk_fwd._common_launch = logged


def child(spec: dict) -> int:
    """One case: for each dtype of ``spec["dtypes"]`` in turn, the forward alone, then forward +
    backward. Prints STAGE / LAUNCH / COMPILED / RESULT / EXC lines for the parent."""
    import torch
    import triton

    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kda_gpu import check_inputs
    from gdn.ops import kda_chunk as KC
    from gdn.ops.triton.kda_chunk import chunk_kda

    apply_config(spec.get("config") or {})
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    say(f"ENV torch {torch.__version__}, triton {triton.__version__}, "
        f"{torch.cuda.get_device_name() if dev == 'cuda' else 'CPU (interpreter)'}")
    log_launches(dev == "cuda")
    name, B, T, H, HV, K, V, lens, g_scale = spec["case"]
    d, cu, do, dS = check_inputs(B, T, H, HV, K, V, lens, g_scale, dev, seed=0)  # the benchmark's draws

    def run(fn, dt, grad):
        wide = torch.float64 if dt == torch.float64 else torch.float32
        xs = {n: x.detach().to(dt if n in ("q", "k", "v") else wide).clone().requires_grad_(grad)
              for n, x in d.items()}
        with torch.set_grad_enabled(grad):
            o, S = fn(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], initial_state=xs["initial_state"],
                      output_final_state=True, cu_seqlens=cu)
        if not grad:
            return {"o": o, "S": S}
        ((o.double() * do).sum() + (S.double() * dS).sum()).backward()
        return {"d" + n: xs[n].grad for n in NAMES}

    def rel(x, ref):
        x = x.detach().double()
        if not torch.isfinite(x).all():
            return math.inf
        return float((x - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))

    refs = {}
    for dt_name in spec["dtypes"]:
        dtype = getattr(torch, dt_name)
        for stage, grad in (("fwd", False), ("bwd", True)):
            say(f"STAGE {stage} {dt_name} start")
            try:
                if stage not in refs:
                    refs[stage] = run(KC.kimi_delta_attention, torch.float64, grad)
                ref = refs[stage]
                if dtype == torch.float32:
                    bounds = {n: FP32_TOL for n in ref}
                else:
                    base = run(KC.kimi_delta_attention, dtype, grad)
                    bounds = {n: 2 * rel(base[n], ref[n]) for n in ref}
            except Exception as e:  # noqa: BLE001 - a failure of the script's reference, not of the kernels
                say(f"EXC {stage} {dt_name} reference (PyTorch chunk form) failed: {type(e).__name__}: {e}")
                return 4
            try:
                got = run(chunk_kda, dtype, grad)
                if dev == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - reported to the parent, which names the kernel
                say(f"EXC {stage} {dt_name} {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                return 3
            errs = {n: rel(got[n], ref[n]) for n in ref}
            worst = max(ref, key=lambda n: errs[n] / max(bounds[n], 1e-30))
            ok = all(errs[n] <= bounds[n] for n in ref)
            say(f"RESULT {stage} {dt_name} {'ok' if ok else 'FAIL'} worst {worst} {errs[worst]:.2e} "
                f"(bound {bounds[worst]:.1e}); " + " ".join(f"{n} {errs[n]:.1e}" for n in ref))
            del got
    return 0


# ----------------------------------------------------------------------------------------------
# Parent: one subprocess per case (a new one for the dtypes left when one dies)
# ----------------------------------------------------------------------------------------------

def child_cmd(spec: dict) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


_ENV_SHOWN: list = []


def run_group(cmd: list[str], env: dict, timeout: float) -> tuple[str, str, int | None]:
    """(stdout, stderr, return code or None when timed out) of ``cmd`` run in its own process group,
    the whole group killed on timeout (compute-sanitizer's target, ptxas processes included)."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return out, err, p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return out, err + f"\ntimed out after {timeout:.0f} s", None


def run_child(spec: dict, timeout: float) -> tuple[dict, list, str]:
    """Run one child; returns ({(stage, dtype): (status, detail, last launch)}, its LAUNCH / COMPILED
    lines, stderr tail). A child that dies leaves the later (stage, dtype) pairs out."""
    out, err, rc = run_group(child_cmd(spec), child_env(), timeout)
    stages, last, current = {}, "-", None
    for line in out.splitlines():
        if line.startswith("ENV ") and not _ENV_SHOWN:
            _ENV_SHOWN.append(line)
            say(line[4:])
        elif line.startswith("LAUNCH "):
            last = line[7:]
        elif line.startswith("STAGE "):
            current = tuple(line.split()[1:3])
            last = "-"
        elif line.startswith("RESULT "):
            _, st, dt, status, detail = line.split(" ", 4)
            stages[(st, dt)] = (status, detail, last)
        elif line.startswith("EXC "):
            _, st, dt, detail = line.split(" ", 3)
            stages[(st, dt)] = ("ERR", detail, last)
    tail = " / ".join(err.strip().splitlines()[-3:])
    trail = [ln for ln in out.splitlines() if ln.startswith(("LAUNCH ", "COMPILED "))]
    if current is not None and current not in stages:  # died without a Python exception (or timed out)
        stages[current] = ("ERR", f"process ended (rc {rc}): {tail}", last)
    if current is None:
        stages[("fwd", spec["dtypes"][0])] = ("ERR", f"no stage started (rc {rc}): {tail}", last)
    return stages, trail, tail


def sweep(label, case, cfg, dtypes, args, left, reserve, show_compiled) -> list:
    """Run one case over ``dtypes`` (one process, a new one after a process dies); print a line per
    (stage, dtype); returns the failing (dtype, kernel launched last before the failure)."""
    failed, todo = [], list(dtypes)
    while todo:
        budget = min(args.case_seconds, left() - reserve)
        if budget < 8:
            for dt in todo:
                say(f"{label} | - | {dt} | SKIP | budget spent")
            break
        t0 = time.monotonic()
        stages, trail, _ = run_child({"case": list(case), "dtypes": todo, "config": cfg}, budget)
        done = []
        for dt in todo:
            if not any(k[1] == dt for k in stages):
                break
            done.append(dt)
            for st in ("fwd", "bwd"):
                status, detail, last = stages.get((st, dt), ("SKIP", "not reached (the process ended before)", "-"))
                say(f"{label} | {st} | {dt} | {status} | {detail} | last launch: {last}")
            bad_here = [v for k, v in sorted(stages.items()) if k[1] == dt and v[0] in ("ERR", "FAIL")]
            if bad_here:
                failed.append((dt, bad_here[0][2].split(" ")[0]))
        bad = len(done) < len(todo) or any(v[0] in ("ERR", "FAIL") for v in stages.values())
        if bad:  # the launches before the failure
            for ln in trail[-6:]:
                say("    " + ln)
        elif show_compiled:  # the kernels' registers, spills and shared memory
            for ln in trail:
                if ln.startswith("COMPILED"):
                    say("    " + ln)
        say(f"    ({time.monotonic() - t0:.1f} s)")
        show_compiled = False
        todo = todo[len(done):] if done else todo[1:]
    return failed


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for pat in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda-*/bin/compute-sanitizer",
                "/opt/nvidia/*/compute-sanitizer/compute-sanitizer", "/usr/local/cuda*/compute-sanitizer/compute-sanitizer"):
        hits = sorted(glob.glob(pat))
        if hits:
            return hits[-1]
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--max-seconds", type=float, default=150.0)
    ap.add_argument("--case-seconds", type=float, default=45.0, help="limit of one subprocess")
    ap.add_argument("--sanitizer", action="store_true", help="memcheck the first failing case")
    ap.add_argument("--sanitizer-seconds", type=float, default=45.0, help="kept for the sanitizer run")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--no-old", action="store_true", help="leave out the first run's configuration row")
    ap.add_argument("--cases", nargs="*", help="only the cases whose name contains one of these")
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--config", default="{}", help="JSON configuration applied in every child")
    ap.add_argument("--dry-run", action="store_true", help="tiny case, CPU interpreter (fp32 and fp16)")
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))

    started = time.monotonic()
    left = lambda: args.max_seconds - (time.monotonic() - started)  # noqa: E731
    reserve = args.sanitizer_seconds if args.sanitizer else 0.0
    base_cfg = json.loads(args.config)
    cases = DRY_CASES if args.dry_run else CASES
    if args.cases:
        cases = [c for c in cases if any(s in c[0] for s in args.cases)]
    dtypes = ["float32", "float16"] if args.dry_run else args.dtypes
    runs = [] if args.no_old or not cases else [("[first-run config] " + cases[0][0], cases[0], {**base_cfg, **OLD})]
    runs += [(c[0], c, base_cfg) for c in cases]
    say(f"kda_debug_gpu: {len(runs)} runs x {len(dtypes)} dtypes, budget {args.max_seconds:.0f} s "
        f"(CUDA_LAUNCH_BLOCKING=1, one subprocess per case; a new one for the dtypes left after a fault)")
    failed = []  # (label, case, config, dtype)
    for i, (label, case, cfg) in enumerate(runs):
        dts = dtypes[:1] if label.startswith("[first-run") else dtypes
        for dt, kernel in sweep(label, case, cfg, dts, args, left, reserve, show_compiled=(i == len(runs) - len(cases))):
            failed.append((label, case, cfg, dt, kernel))
    real = [f for f in failed if not f[0].startswith("[first-run")]
    if real and not args.no_variants:
        label, case, cfg, dt, kernel = real[0]
        short = kernel.removesuffix("_kernel")
        say(f"--- variants on the first failing case: {label}, {dt} (last launch {kernel})")
        for vname, vcfg in sorted(VARIANTS, key=lambda v: short not in v[1]):
            merged = {**cfg}
            for k, v in vcfg.items():
                merged[k] = {**merged.get(k, {}), **v} if isinstance(v, dict) else v
            sweep(f"variant {vname}: {label}", case, merged, [dt], args, left, reserve, False)
    if args.sanitizer:
        target = (real or failed or [(runs[0][0], runs[0][1], runs[0][2], dtypes[0], "-")])[0] if runs else None
        tool = find_sanitizer()
        if target is None or tool is None:
            say(f"sanitizer: {'compute-sanitizer not found' if tool is None else 'no case'}")
        else:
            label, case, cfg, dt = target[:4]
            budget = max(10.0, left() - 5)
            say(f"--- compute-sanitizer memcheck: {label}, {dt} ({tool}, {budget:.0f} s)")
            cmd = [tool, "--tool", "memcheck", "--print-limit", "20"] + child_cmd(
                {"case": list(case), "dtypes": [dt], "config": cfg})
            env = child_env({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
            out, err, _ = run_group(cmd, env, budget)
            lines = (out + err).splitlines()
            report = [ln for ln in lines if ln.startswith("=========")] or lines
            for ln in report[:40]:
                say(ln)
            launches = [ln for ln in lines if ln.startswith(("LAUNCH", "COMPILED", "RESULT", "EXC"))]
            for ln in launches[-4:]:
                say("  child: " + ln)
    say(f"done in {time.monotonic() - started:.1f} s; {len(failed)} failing (run, dtype) pairs")
    return 1 if real else 0


if __name__ == "__main__":
    sys.exit(main())
