"""What the chunk kernels compile to on the H200, measured without a GPU.

Records the launches of one forward + backward of the Triton chunk op (the delta family, or with
``--op kda`` the KDA chunk kernels of :mod:`gdn.ops.kda.triton`) at a benchmark shape (on the
CPU: :func:`gdn.ops.triton.launch.recording` collects the launches instead of running them, with the card's 132
multiprocessors assumed for the occupancy rules), compiles each kernel for sm_90 as Triton's
launcher would (its binder's specialisation of the arguments, the constexprs, warps and pipeline
depth; Triton's bundled ptxas), and prints per kernel:
registers, spills (the stack frame, and ptxas -v's "bytes spill stores / loads"), shared memory, the programs one multiprocessor can hold (by shared memory,
registers and warps), the number of waves of the grid, and the instruction mix of the innermost
loop (a sequential pass's chunk step). Nothing here replaces timing on the card; it says why a
configuration can or cannot overlap programs (e.g. the state passes' pipelined tiles take 119 KB of
shared memory at value tiles of 32: one program per multiprocessor, so 256 programs run in two
waves).

    python tools/sass_cpu.py --shape 4x8192 [--hv 32] [--kernels state_bwd,state_fwd] [--sass DIR]
    python tools/sass_cpu.py --shape 4x4096 --h 6 --v 256 --depths   # each pass's candidates and choice
    python tools/sass_cpu.py --shape 4x8192 --config '{"state_out": {"from_inverse": true}}'
    python tools/sass_cpu.py --op kda --shape 4x8192 [--dtype fp32]      # the KDA chunk kernels
    python tools/sass_cpu.py --shape 1x32768 --hv 64 --hopper   # the H200's own path (Gluon kernels too)

Without ``--hopper`` the delta family's launches are those of a card without the Gluon kernels
(Triton's chunk kernels throughout); with it, those the H200 makes (its warp-specialised passes and
fused backward, and the Triton kernels beside them: kkt_solve without the pair matrix, warm_plan).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gdn.ops.delta.triton import chunk, chunk_bwd, chunk_fwd  # noqa: E402
from gdn.ops.kda.triton import chunk as kda_chunk  # noqa: E402
from gdn.ops.kda.triton import chunk_bwd as kda_bwd  # noqa: E402
from gdn.ops.kda.triton import chunk_fwd as kda_fwd  # noqa: E402
from gdn.ops.triton import common  # noqa: E402
from gdn.ops.triton import launch as launcher  # noqa: E402
from gdn.ops.tuning import DELTA, apply_config  # noqa: E402
from triton.backends.nvidia.compiler import sm_arch_from_capability  # noqa: E402
from triton.compiler import make_backend  # noqa: E402

from ptx_fingerprint import TARGET, compile_launch, device_rules, launch_key  # noqa: E402  (the launcher's own compile inputs)

_BACKEND, _BINDERS = make_backend(TARGET), {}

SMS = 132  # H200 multiprocessors (per multiprocessor: launcher.SM90)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _card_sms():
    """Make the launchers size their grids for the H200's multiprocessors (:data:`SMS`) and take
    the tensor-descriptor paths the H200 takes (``has_tma``)."""
    # every module of gdn that sizes grids or splits (split, fused_fwd, fused_rev among them)
    device_rules({"sm_count": lambda device: SMS, "has_tma": lambda x: True})


def record(B, T, H, HV, K, V=None, dtype=torch.bfloat16):
    """The launches (kernel, grid, args, meta) of one forward + backward, gated delta rule."""
    V = V or K
    _card_sms()
    q = torch.empty(B * T, H, K, dtype=dtype)
    k, v = torch.empty_like(q), torch.empty(B * T, HV, V, dtype=dtype)
    g, beta = torch.empty(B * T, HV), torch.empty(B * T, HV)
    ch = common.make_chunks(B, T, None, torch.device("cpu"))
    plans = {}  # what the forward hands its backward (as the autograd node does)
    with launcher.recording() as launches:
        _, _, ai, gam = chunk._forward(q, k, v, g, beta, None, ch, False, K ** -0.5, dtype, plans=plans)
        chunk_bwd.backward(q, k, v, g, beta, None, v, None, ch, K ** -0.5, ai, dtype, gam, plans=plans)
    return launches


def record_kda(B, T, H, HV, K, V=None, dtype=torch.bfloat16):
    """The launches of one KDA chunk forward + backward (with final state and its gradient), as
    :func:`gdn.ops.kda.triton.chunk.dry_run` makes them."""
    V = V or K
    _card_sms()
    q = torch.empty(B * T, H, K, dtype=dtype)
    k, v = torch.empty_like(q), torch.empty(B * T, HV, V, dtype=dtype)
    g, beta = torch.zeros(B * T, HV, K), torch.empty(B * T, HV)
    ch = common.make_chunks(B, T, None, torch.device("cpu"))
    with launcher.recording() as launches:
        kda_chunk.dry_run(q, k, v, g, beta, None, ch, True, K ** -0.5, dtype if HV == H else torch.float32)
    return launches


def ptxas_spills(ck):
    """(bytes stack frame, bytes spill stores, bytes spill loads) that ``ptxas -v`` reports for the
    kernel's PTX (the bundled ptxas, the GPU name Triton compiles for)."""
    ptx = os.path.join("/tmp", f"sass_cpu_{os.getpid()}.ptx")
    with open(ptx, "w") as f:
        f.write(ck.asm["ptx"])
    arch = sm_arch_from_capability(90)
    log = subprocess.run([os.path.join(BIN, "ptxas"), "-lineinfo", "-v", f"--gpu-name={arch}", ptx, "-o", ptx + ".o"],
                         capture_output=True, text=True).stderr
    for f in (ptx, ptx + ".o"):
        if os.path.exists(f):
            os.unlink(f)
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return tuple(int(x) for x in m.groups()) if m else (-1, -1, -1)


def resources(ck, with_sass=False):
    """(registers, stack bytes, shared bytes[, SASS text]) of a compiled kernel."""
    cubin = os.path.join("/tmp", f"sass_cpu_{os.getpid()}.cubin")
    with open(cubin, "wb") as f:
        f.write(ck.asm["cubin"])
    tool = os.path.join(BIN, "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
    sass = subprocess.run([tool, "--dump-sass", cubin], capture_output=True, text=True).stdout if with_sass else None
    os.unlink(cubin)
    # spilled registers live on the thread's stack (STACK); LOCAL counts only local arrays
    out = (int(re.search(r"REG:(\d+)", usage).group(1)),
           int(re.search(r"STACK:(\d+)", usage).group(1)) + int(re.search(r"LOCAL:(\d+)", usage).group(1)),
           ck.metadata.shared)
    return out + (sass,) if with_sass else out


def per_sm(regs, smem, warps):
    """Programs one multiprocessor holds (the rule the launcher decides pipeline depths with)."""
    return launcher.per_sm(smem, regs, warps, launcher.SM90)


def depths(launches):
    """Each launch of a sequential pass with its candidates (``DELTA[...]["stages"]``: pipeline
    depths and forms): shared KB, registers, programs per multiprocessor, waves of its grid, and
    the candidate the launcher's fewest-waves rule (:func:`gdn.ops.triton.launch.pick`) takes on
    the H200."""
    print("\n| pass | BV | programs | candidate (stages, form) | shared KB | regs | per SM | waves | chosen |")
    print("|---|---|---|---|---|---|---|---|---|")
    groups = {}
    for kernel, grid, kargs, meta in launches:
        name = kernel.fn.__name__
        if name not in ("state_fwd_kernel", "state_out_kernel", "state_bwd_kernel"):
            continue
        groups.setdefault((name, meta.get("BV"), tuple(grid)), (kernel, grid, kargs, meta))
    for (name, bv, grid), (kernel, _, kargs, meta) in groups.items():
        programs = grid[0] * grid[1]
        base = {k: v for k, v in meta.items() if k not in ("num_stages", "QS")}
        pname = name[:-7]
        rows = []
        for ns, form in launcher.candidates(DELTA[pname]["stages"]):
            regs, _, smem = resources(compile_sm90(kernel, kargs, dict(base, **form, num_stages=ns)))
            rows.append(((ns, form), smem, regs, per_sm(regs, smem, meta["num_warps"])))
        chosen = launcher.pick([(c, n) for c, _, _, n in rows], programs, SMS)
        for c, smem, regs, n in rows:
            label = f"{c[0]}" + (" " + ",".join(k for k, v in c[1].items() if v) if c[1] else "")
            print(f"| {pname} | {bv} | {programs} | {label} | {smem / 1024:.0f} | {regs} | {n} | "
                  f"{-(-programs // (SMS * max(n, 1)))} | {'**yes**' if c == chosen else ''} |", flush=True)


def compile_sm90(kernel, args, meta):
    """Compile ``kernel`` for sm_90 as Triton's launcher would for the recorded arguments: its
    binder's specialisation of each run-time argument (an int's divisibility by 16 unless
    ``do_not_specialize``, a pointer's alignment), the constexprs, warps and pipeline depth."""
    return compile_launch(launch_key(kernel, args, meta, _BACKEND, _BINDERS)[1])


def loop_mix(sass: str):
    """(instructions, Counter of opcodes) of the kernel's main loop: of the loops (a backward branch
    and its body), the one with the most matrix-product instructions (HMMA, HGMMA), the innermost
    (shortest) of those; without any, the innermost that is not a spin-wait (a body of three
    instructions or fewer: a barrier poll and its branch)."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s*(.*?);", sass)]
    best, best_key = None, None
    for addr, txt in ins:
        m = re.search(r"BRA.*?0x([0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            body = [t for a, t in ins if lo <= a <= addr]
            if len(body) <= 3:
                continue
            key = (-sum(bool(re.match(r"(@!?U?P\w+\s+)?H(G)?MMA", t)) for t in body), len(body))
            if best_key is None or key < best_key:
                best, best_key = body, key
    if not best:
        return 0, collections.Counter()
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best)
    return len(best), ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=("delta", "kda"), default="delta",
                    help="the gated delta rule's chunk kernels or the KDA chunk kernels")
    ap.add_argument("--shape", default="4x8192", help="BxT (H = 16, K = V = 128 unless given)")
    ap.add_argument("--dtype", choices=tuple(NAMES), default="bf16")
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--hv", type=int, default=None, help="value heads (default H)")
    ap.add_argument("--k", type=int, default=128, help="key width K")
    ap.add_argument("--v", type=int, default=None, help="value width V (default K)")
    ap.add_argument("--depths", action="store_true",
                    help="the sequential passes at each of their launch candidates, and the one the launcher takes")
    ap.add_argument("--kernels", default=None, help="comma-separated names, with or without the _kernel suffix (default every launched kernel)")
    ap.add_argument("--sass", default=None, metavar="DIR", help="also write each kernel's SASS there")
    ap.add_argument("--config", default=None, metavar="JSON",
                    help="launch overrides (a file or inline JSON, gdn.ops.tuning.update_from), e.g. "
                         "'{\"kda.kkt\": {\"num_warps\": 4}}'")
    ap.add_argument("--hopper", action="store_true",
                    help="the delta family's launches on the H200's path (its Gluon kernels and those beside them)")
    args = ap.parse_args()
    if args.hopper:
        from gdn.ops.delta.triton import fused_bwd, fused_fwd, fused_rev  # noqa: PLC0415

        for mod in (fused_bwd, fused_fwd, fused_rev):
            mod.hopper = lambda q: True
    apply_config(ap, args.config)
    B, T = (int(x) for x in args.shape.lower().split("x"))
    HV = args.hv or args.h
    # a name with or without its "_kernel" suffix (state_bwd or state_bwd_kernel)
    want = None if args.kernels is None else {n.strip().removesuffix("_kernel") + "_kernel"
                                              for n in args.kernels.split(",")}
    print(f"H200 (sm_90) compile of the launches of one fwd+bwd ({args.op}) at B={B}, T={T}, H={args.h}, HV={HV}, "
          f"K={args.k}, V={args.v or args.k}, {args.dtype}; {SMS} multiprocessors, "
          f"{launcher.SM90['shared'] // 1024} KB shared each")
    launches = (record_kda if args.op == "kda" else record)(B, T, args.h, HV, args.k, args.v, NAMES[args.dtype])
    if args.depths:
        if args.op == "kda":
            raise SystemExit("--depths: the delta family's sequential passes only")
        depths(launches)
        return
    print("\n| kernel | BK | BV | warps (with the workers') | stages | regs | stack B | spill st/ld B | shared KB | programs / SM | grid "
          "| waves | loop instrs | loop mix (top 8) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    seen = set()
    for kernel, grid, kargs, meta in launches:
        name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
        key = (name, tuple(sorted((k, str(v)) for k, v in meta.items())))
        if (want and name not in want) or key in seen:
            continue
        seen.add(key)
        ck = compile_sm90(kernel, kargs, meta)
        regs, _, smem, sass = resources(ck, with_sass=True)
        stack, st, ld = ptxas_spills(ck)
        # a warp-specialised (Gluon) kernel runs its worker partitions' warps beside the launch's:
        # the compiled kernel counts them all (in whole warpgroups), and occupancy is by that count
        total = getattr(ck.metadata, "num_warps", meta["num_warps"])
        n_sm = per_sm(regs, smem, total)
        programs = 1
        for d in grid:
            programs *= d
        waves = programs / (SMS * max(n_sm, 1))
        n, mix = loop_mix(sass)
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            with open(os.path.join(args.sass, f"{name}_{len(seen)}.sass"), "w") as f:
                f.write(sass)
        top = ", ".join(f"{k} {v}" for k, v in mix.most_common(8))
        warps = f"{meta['num_warps']}" + (f" ({total})" if total != meta["num_warps"] else "")
        print(f"| {name} | {meta.get('BK', '-')} | {meta.get('BV', '-')} | {warps} | {meta.get('num_stages', '-')} "
              f"| {regs} | {stack} | {st}/{ld} | {smem / 1024:.0f} | {n_sm} | {programs} | {waves:.2f} | {n} | {top} |",
              flush=True)


if __name__ == "__main__":
    main()
