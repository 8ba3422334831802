"""Fingerprints of what every Triton kernel compiles to for the H200 (sm_90), made without a GPU: a
change to kernel code that leaves every fingerprint equal hands ptxas the same programs.

Runs a set of workloads on CPU tensors with every Triton launch captured instead of run (the chunk
ops of both families with and without each optional input, packed and split; the token-recurrent
and speculative-step kernels; two small hybrid models forward and backward and their decode steps,
eager and on the static cache; the glue kernels on strided rows; each in bf16 and fp32), then
compiles each distinct launch the way Triton's own launcher would on an sm_90 device (its binder's
specialisation of the arguments, its option parsing, then ``triton.compile``) and hashes the PTX
without its debug information (line directives, DWARF sections, comments), so moved lines do not
count. Not the SASS: ptxas does not always give the same SASS for the same PTX (two cold compiles
of state_bwd_kernel at fp32 differed). Outputs are garbage (nothing runs); only the launches matter.

    python tools/ptx_fingerprint.py --out before.json            # on the tree before a change
    python tools/ptx_fingerprint.py --out after.json --compare before.json
    python tools/ptx_fingerprint.py --out kda.json --workloads kda        # some workloads only
    python tools/ptx_fingerprint.py --out h.json --hopper --workloads hopper   # the Gluon kernels' paths
    python tools/ptx_fingerprint.py --out h2.json --hopper --config '{"fused_bwd": {"items": 2}}'

With ``--hopper`` the chunk workloads of both families run a second time on the H200's paths (the
Hopper and tensor-copy tests true: the Gluon kernels of ``gdn.ops.delta.triton.fused_fwd``,
``fused_rev`` and ``fused_bwd`` for 16-bit inputs, and the Triton kernels' tensor-descriptor forms
where a launch setting asks for them), as ``... hopper`` workloads.

With ``--compare`` it lists each launch whose PTX differs, and launches found in only one of
the two runs, then exits 1 if any differ. The kernels of ``gdn`` that no workload launched are
listed at the end: for them the comparison proves nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TARGET = GPUTarget("cuda", 90, 32)
DEBUG_LABEL = re.compile(r"\$L__tmp\d+:")  # labels only the line tables refer to (one per inlined scope)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
SMS = 132  # the H200's multiprocessors: tile and pass choices as on the card


def device_rules(rules: dict, prefixes=("gdn.",)) -> list:
    """Set each of ``rules`` ({name: function}: a device test such as ``sm_count`` or ``has_tma``) on
    every loaded module whose name starts with one of ``prefixes`` and has that function, so that
    every module deciding grids, splits or paths sees the card's answers; [(module, name, old
    function)], to put back."""
    patched = []
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "") or ""
        if name.startswith(prefixes) or name in prefixes:
            for attr, value in rules.items():
                if callable(getattr(mod, attr, None)):
                    patched.append((mod, attr, getattr(mod, attr)))
                    setattr(mod, attr, value)
    return patched


@contextlib.contextmanager
def captured(hopper: bool = False):
    """Inside: every ``kernel[grid](...)`` and every :func:`gdn.ops.triton.launch.launch` records
    (kernel, args, keywords) into the yielded list and runs nothing; the ops take their Triton
    path on CPU tensors, and the launchers size grids for :data:`SMS` multiprocessors. With
    ``hopper`` the Gluon kernels' Hopper test and the tensor-copy test are true as well (their
    modules' ``hopper`` and ``has_tma``)."""
    from gdn.ops.triton import launch as launcher

    out = []
    saved = JITFunction.__getitem__

    def getitem(self, grid):
        def run(*args, **kwargs):
            out.append((self, args, kwargs))
        return run

    patched = device_rules({"use_triton": lambda x: True, "sm_count": lambda device: SMS,
                            "hopper": lambda x: hopper, "has_tma": lambda x: hopper},
                           ("gdn.", "tools.", "__main__"))
    JITFunction.__getitem__ = getitem
    try:
        with launcher.recording() as rec:
            yield out
            for kernel, _, args, meta in rec:  # launch(): its candidates, as the card would compile them
                out.append((kernel, args, meta))
    finally:
        JITFunction.__getitem__ = saved
        for mod, attr, value in patched:
            setattr(mod, attr, value)


def workloads(dtypes):
    """(name, callable) pairs; each callable runs one workload on CPU tensors."""
    from gdn.ops import tuning
    from gdn.ops.delta.triton.chunk import chunk_op
    from gdn.ops.delta.triton.pool import commit_spec_states, fused_recurrent_gated_delta_rule_spec
    from gdn.ops.delta.triton.recurrent import fused_recurrent_gated_delta_rule
    from gdn.ops.kda.triton.chunk import chunk_kda
    from gdn.ops.kda.triton.recurrent import recurrent_kda

    def inputs(T, H, HV, K, V, dt, per_channel=False, N=2, grad=True):
        g = torch.Generator().manual_seed(0)

        def r(*s, dtype=dt):
            return torch.randn(*s, generator=g, dtype=dtype).requires_grad_(grad)

        B = 1 if N > 2 else N
        q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
        gate = (-torch.rand(B, T, HV, *((K,) if per_channel else ()), generator=g)).requires_grad_(grad)
        beta = torch.rand(B, T, HV, generator=g).requires_grad_(grad)
        h0 = r(N, HV, K, V, dtype=torch.float32)
        return q, k, v, gate, beta, h0

    def chunk(op, dt, g_on, b_on, per_channel=False, packed=False, K=128, V=128, HV=32, split=0):
        def run():
            N = 3 if packed else 2
            q, k, v, gate, beta, h0 = inputs(256 if packed else 200, 16, HV, K, V, dt, per_channel, N)
            cu = torch.tensor([0, 100, 130, 256], dtype=torch.int32) if packed else None
            saved = tuning.DELTA["split"]
            tuning.DELTA["split"] = dict(saved, L=split)  # the split state passes when > 0 (a new entry: tuning.token)
            try:
                o, ht = op(q, k, v, gate if g_on else None, beta if b_on else None, initial_state=h0,
                           output_final_state=True, cu_seqlens=cu)
                (o.float().sum() + ht.sum()).backward()
            finally:
                tuning.DELTA["split"] = saved
        return run

    def recurrent(dt):
        def run():
            q, k, v, gate, beta, h0 = inputs(3, 16, 32, 128, 128, dt, grad=False)
            fused_recurrent_gated_delta_rule(q, k, v, gate, beta, initial_state=h0, output_final_state=True)
            o, states = fused_recurrent_gated_delta_rule_spec(q, k, v, gate, beta, initial_state=h0)
            commit_spec_states(h0.clone(), torch.tensor([1, 0]), states, torch.tensor([2, 3]))
            q, k, v, gate, beta, h0 = inputs(40, 16, 32, 128, 256, dt, per_channel=True)
            o, ht = recurrent_kda(q, k, v, gate, beta, initial_state=h0, output_final_state=True)
            (o.float().sum() + ht.sum()).backward()
        return run

    def glue_strided(dt):
        def run():  # column slices of a wider product: the glue kernels' STRIDED variants
            from gdn.ops.delta.triton.prologue import prologue
            from gdn.ops.triton.rmsnorm import gated_rms_norm
            from gdn.ops.triton.swiglu import swiglu_backward, swiglu_forward

            g = torch.Generator().manual_seed(1)
            wide = torch.randn(2, 70, 4 * 256 + 2 * 32, generator=g, dtype=dt).requires_grad_()
            gate, up = wide[..., :256], wide[..., 256:512]
            h = swiglu_forward(gate, up)
            swiglu_backward(torch.ones_like(h), gate, up)
            x, z = wide[..., 512:640].unflatten(-1, (2, 64)), wide[..., 640:768].unflatten(-1, (2, 64))
            gated_rms_norm(x, z, torch.ones(64, dtype=dt)).float().sum().backward(retain_graph=True)
            q, k = wide[..., 768:896].unflatten(-1, (2, 64)), wide[..., 896:1024].unflatten(-1, (2, 64))
            a, b = wide[..., 1024:1056], wide[..., 1056:1088]
            qn, kn, gg, beta = prologue(q, k, a, b, torch.zeros(32), torch.zeros(32), True, True)
            (qn.float().sum() + kn.float().sum() + gg.sum() + beta.float().sum()).backward()
            # the short convolution on a column block: with a history, and packed (the model
            # workloads run it without either)
            from gdn.ops.triton.short_conv import short_conv

            w = torch.randn(128, 4, generator=g)
            short_conv(wide[..., 768:896], w, torch.randn(2, 128, 3, generator=g, dtype=dt)).float().sum().backward()
            cu = torch.tensor([0, 5, 40, 70])
            short_conv(wide[:1, :, 768:896], w, None, cu).float().sum().backward()
        return run

    def model(preset, dt):
        def run():
            from gdn.models import GDNConfig, GDNForCausalLM
            from gdn.generation import generate

            cfg = GDNConfig.from_preset(preset, "tiny")
            m = GDNForCausalLM(cfg).to(dt)
            ids = torch.randint(0, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
            m(input_ids=ids, labels=ids).loss.backward()
            m.eval()
            with torch.no_grad():
                generate(m, ids[:, :9], max_new_tokens=3)
                generate(m, ids[:, :9], max_new_tokens=3, graph=True)  # the static-cache decode step
        return run

    for dt in dtypes:
        tag = str(dt).split(".")[-1]
        for g_on in (True, False):
            for b_on in (True, False):
                yield f"chunk {tag} g={g_on} beta={b_on}", chunk(chunk_op, dt, g_on, b_on)
        yield f"chunk {tag} packed", chunk(chunk_op, dt, True, True, packed=True)
        yield f"chunk {tag} K=V=64 HV=16", chunk(chunk_op, dt, True, True, K=64, V=64, HV=16)
        yield f"chunk {tag} split", chunk(chunk_op, dt, True, True, split=2)
        yield f"kda chunk {tag}", chunk(chunk_kda, dt, True, True, per_channel=True)
        yield f"kda chunk {tag} packed", chunk(chunk_kda, dt, True, True, per_channel=True, packed=True)
        yield f"recurrent {tag}", recurrent(dt)
        yield f"glue strided {tag}", glue_strided(dt)
        for preset in ("gdn-h2", "qwen3next"):
            yield f"model {preset} {tag}", model(preset, dt)


def launch_key(kernel, args, kwargs, backend, binders):
    """(key text, compile inputs) of one captured launch, as Triton's launcher computes them."""
    binder = binders.get(kernel)
    if binder is None:
        binder = binders[kernel] = create_function_from_signature(kernel.signature, kernel.params, backend)
    kw = dict(kwargs)
    kw["debug"] = kw.get("debug", kernel.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, spec, opts = binder(*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, spec, opts)
    name = f"{kernel.fn.__module__}.{kernel.fn.__qualname__}"
    consts = sorted((".".join([kernel.params[k[0]].name] + [str(i) for i in k[1:]]), repr(v))
                    for k, v in constexprs.items())
    text = json.dumps([name, signature, consts,
                       sorted((str(k), repr(v)) for k, v in attrs.items()),
                       {k: options.__dict__[k] for k in ("num_warps", "num_stages", "num_ctas", "maxnreg")
                        if k in options.__dict__}], default=str)
    return text, (kernel, signature, constexprs, attrs, options)


def compile_launch(inputs):
    """The compiled kernel of a launch's compile inputs (:func:`launch_key`'s) for sm_90: Triton's
    compiler on its AST, or Gluon's for a Gluon kernel."""
    kernel, signature, constexprs, attrs, options = inputs
    source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    return triton.compile(source(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def compile_hashes(inputs, dump=None) -> dict:
    """{"ptx": hash of the PTX without its debug information (line directives, the labels of the
    line tables, DWARF sections, comments), "sass": hash of the SASS instructions} of one launch compiled for sm_90. Equal PTX
    is the same program handed to ptxas; equal SASS is the same machine code. Either proves a
    change left the launch alone; neither is implied by the other (ptxas does not always give the
    same SASS for the same PTX: state_bwd_kernel at fp32, two cold compiles; and PTX that differs
    only in the order of independent instructions can assemble to the same SASS). ``dump``: a
    file to write the PTX without its debug information to."""
    ck = compile_launch(inputs)
    ptx = ck.asm["ptx"]
    cut = ptx.find(".section\t.debug")
    body = [ln for ln in (ln.split("//", 1)[0].strip() for ln in (ptx if cut < 0 else ptx[:cut]).splitlines())
            if ln and not ln.startswith((".loc", ".file")) and not DEBUG_LABEL.fullmatch(ln)]
    if dump:
        with open(dump, "w") as f:
            f.write("\n".join(body) + "\n")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    instrs = [ln.strip() for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    return {"ptx": hashlib.sha256("\n".join(body).encode()).hexdigest()[:16],
            "sass": hashlib.sha256("\n".join(instrs).encode()).hexdigest()[:16]}


def all_kernels() -> set:
    """Every @triton.jit and @gluon.jit kernel of gdn's modules that are imported (qualified names)."""
    out = set()
    for mod in list(sys.modules.values()):
        if (getattr(mod, "__name__", "") or "").startswith("gdn."):
            for v in vars(mod).values():
                if isinstance(v, JITFunction) and v.fn.__name__.endswith("kernel"):
                    out.add(f"{v.fn.__module__}.{v.fn.__qualname__}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where to write {launch key: {ptx, sass: hash}} (JSON)")
    ap.add_argument("--compare", default=None, metavar="JSON", help="an earlier --out to compare with")
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma-separated, of bf16, fp16, fp32")
    ap.add_argument("--workloads", default=None, metavar="TEXT",
                    help="only the workloads whose name contains TEXT (e.g. 'kda', 'model', 'recurrent float32')")
    ap.add_argument("--dump", default=None, metavar="DIR",
                    help="also write each launch's PTX (without debug information) there, for diffing")
    ap.add_argument("--hopper", action="store_true",
                    help="also the delta chunk workloads on the H200's paths (the Gluon kernels)")
    ap.add_argument("--config", default=None, metavar="JSON",
                    help="launch settings over the defaults first (gdn.ops.tuning.update_from: inline JSON or "
                         "a file), e.g. '{\"fused_bwd\": {\"items\": 2}}'")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="compile threads")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the kernels must compile, not interpret")
    from gdn.ops.tuning import apply_config  # noqa: PLC0415

    apply_config(ap, a.config)
    import gdn.generation  # noqa: F401, PLC0415  (every module the workloads reach, imported before
    import gdn.models  # noqa: F401, PLC0415   captured() patches their routing)
    import gdn.ops.delta.triton.fused_bwd  # noqa: F401, PLC0415  (and the Gluon kernels' Hopper tests,
    import gdn.ops.delta.triton.fused_fwd  # noqa: F401, PLC0415   imported by the chunk op only once it
    import gdn.ops.delta.triton.fused_rev  # noqa: F401, PLC0415   first runs)
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[d] for d in a.dtypes.split(",")]
    t0 = time.time()
    backend, binders, launches, failed = make_backend(TARGET), {}, {}, []
    runs = [(name, run, False) for name, run in workloads(dtypes)]
    if a.hopper:
        runs += [(name + " hopper", run, True) for name, run, _ in runs if name.startswith(("chunk ", "kda chunk "))]
    for name, run, hopper in runs:
        if a.workloads and a.workloads not in name:
            continue
        with captured(hopper) as got:
            try:
                run()
            except Exception as e:  # noqa: BLE001 - a workload that cannot run on the CPU is reported, not fatal
                failed.append(f"{name}: {type(e).__name__}: {e}")
        for kernel, args, kwargs in got:
            text, inputs = launch_key(kernel, args, kwargs, backend, binders)
            launches.setdefault(text, inputs)
    print(f"{len(launches)} distinct launches captured in {time.time() - t0:.0f} s; compiling for sm_90", flush=True)
    keys = sorted(launches)
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)

    def one(i_key):
        i, key = i_key
        dump = None if not a.dump else os.path.join(a.dump, f"{json.loads(key)[0].rsplit('.', 1)[1]}.{i:04d}.ptx")
        return compile_hashes(launches[key], dump)

    with ThreadPoolExecutor(max(1, a.workers)) as ex:
        hashes = dict(zip(keys, ex.map(one, enumerate(keys))))
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(hashes, f, indent=1, sort_keys=True)
    os.replace(tmp, a.out)
    seen = {json.loads(k)[0] for k in keys}
    missing = sorted(all_kernels() - seen)
    print(f"{len(hashes)} launches of {len(seen)} kernels fingerprinted in {time.time() - t0:.0f} s -> {a.out}")
    for f in failed:
        print(f"workload failed (its launches up to the failure are kept): {f}")
    if missing and not a.workloads:
        print("kernels no workload launched (not covered):\n  " + "\n  ".join(missing))
    if a.compare is None:
        return 0
    with open(a.compare) as f:
        old = json.load(f)
    # the same launch when its PTX or its SASS is unchanged (compile_hashes says why either suffices)
    changed = [k for k in keys if k in old and all(old[k][h] != hashes[k][h] for h in ("ptx", "sass"))]
    only_new, only_old = [k for k in keys if k not in old], [k for k in old if k not in hashes]
    if a.workloads:  # a partial run: the earlier run's other launches were not made, not lost
        only_old = []
    for label, rows in (("PTX and SASS differ", changed), ("only in this run", only_new), ("only in " + a.compare, only_old)):
        for k in rows:
            name, sig, consts = json.loads(k)[:3]
            print(f"{label}: {name} {dict(consts)}")
    same = len(keys) - len(changed) - len(only_new)
    by_sass = sum(1 for k in keys if k in old and old[k]["ptx"] != hashes[k]["ptx"] and k not in changed)
    print(f"{same} of {len(keys)} launches compile to the same PTX or SASS ({by_sass} by their SASS only); "
          f"{len(changed)} differ, "
          f"{len(only_new)} new, {len(only_old)} gone")
    return 1 if changed or only_new or only_old else 0


if __name__ == "__main__":
    raise SystemExit(main())
