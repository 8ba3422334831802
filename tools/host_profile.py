"""Host (Python) time of one chunk-op call against its GPU time, and where the host time goes.

A call whose host side takes longer than its kernels leaves the GPU idle between launches, and
``do_bench`` then times the host. This prints, per pass at one shape: the host µs per call (calls
queued back to back, timed before the final synchronisation), the GPU µs per call (the same calls
replayed from a CUDA graph where capture works, else the sum of the profiled kernels), and the
functions with the most own and cumulative host time (cProfile).

    python tools/host_profile.py --shape 8x2048 [--heads 16 --hv 16] [--top 25]

With ``--timeline``: where one forward + backward's host time goes in order, from calls run back to
back with marks at each kernel launch and at the chunk op's autograd Function (on the H200 this
located the host time the autograd engine takes around the backward, and each launch's cost).

The inputs and the call are benchmarks/ops_gpu.py's (bf16, K = V = 128).

With ``--ab`` (CUDA): the forward's and the forward + backward's host and wall µs per call through
Triton's launch path and through gdn's, interleaved in one process (:func:`launch_ab`).

With ``--launches`` (CUDA): the host µs of each kernel launch of one forward + backward at the
shape, repeated back to back with a one-program grid (the host's cost does not depend on the grid,
and the GPU keeps up): through Triton's launch path (``kernel[grid](*args, **meta)``: argument
binding, specialisation key, cache lookup, launcher) and through the compiled kernel's launcher
alone (arguments bound once), beside a one-argument Triton kernel, ``torch.empty`` and an in-place
add; then the functions Triton's path spends the launch with the most arguments in (cProfile). It
says how much of a call's host time is the launch mechanism rather than gdn's own work, and where.

With ``--cpu-stub`` (no GPU needed) the same calls take the Triton path on CPU tensors with every
kernel launch replaced by a no-op: what is left is gdn's own host work per call (argument checks,
chunk layout, tile and pass choices, allocations), without Triton's launch path or the CUDA
runtime; ``--hopper`` takes the H200's paths (the Gluon kernels' host side). Its outputs are
garbage; only the time is meant. The tool runs itself again with glibc keeping freed large blocks
in its heap (:data:`HEAP_ENV`), so that an allocation costs about what CUDA's caching allocator
charges, not an mmap and munmap.

With ``--calibrate``: the host µs of a few fixed workloads on this machine (a pure-Python loop of
the kind the launch path runs, a trivial autograd Function's forward + backward, an allocation and a
view on the device), to compare one host's speed with another's before reading host figures across
machines (the CPU stub's against the GPU host's).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import platform
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if "--cpu-stub" in sys.argv:  # before triton is imported: its interpreter takes CPU tensors
    import os

    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from ops_gpu import D, gdn_fn, inputs, kernel_events  # noqa: E402

DEVICE = "cpu" if "--cpu-stub" in sys.argv else "cuda"
LAUNCHES: collections.Counter = collections.Counter()  # kernel name -> launches, under --cpu-stub


#: glibc settings that keep freed large blocks in the heap for reuse: by default each torch.empty of a
#: [T, HV, K] buffer is its own mmap and munmap (≈ 10 µs of host on the CPU), where CUDA's caching
#: allocator reuses blocks (≈ 2 µs), so the stub would charge the op for the CPU's allocator
HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2 ** 35), "MALLOC_TRIM_THRESHOLD_": str(2 ** 35),
            "MALLOC_TOP_PAD_": str(2 ** 30)}


def heap_kept() -> bool:
    """Whether this process runs with :data:`HEAP_ENV` set."""
    return all(os.environ.get(k) == v for k, v in HEAP_ENV.items())


def heap_allocations() -> None:
    """Run this process again with :data:`HEAP_ENV` set (glibc reads it at start), unless it is."""
    if heap_kept():
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **HEAP_ENV})


def calibrate(device: str) -> list:
    """[(workload, µs a call)] of fixed host workloads on ``device`` (:func:`host_us` of each)."""
    def python_loop():  # tuples, dict lookups and small calls: what a launch key's work is made of
        d = {}
        for i in range(200):
            k = (i & 7, "x", i % 3)
            d[k] = d.get(k, 0) + len(k)
        return d

    class Ident(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    x = torch.zeros(16, device=device, requires_grad=True)
    g = torch.ones(16, device=device)

    def autograd_call():
        x.grad = None
        Ident.apply(x).backward(g)

    y = torch.empty(1 << 20, device=device)
    return [("pure-Python loop (200 dict updates)", host_us(python_loop, 2000)),
            ("autograd Function forward + backward", host_us(autograd_call, 2000)),
            ("torch.empty, 64 MB", host_us(lambda: torch.empty(1 << 24, device=device), 2000)),
            ("a view (reshape)", host_us(lambda: y.view(1024, 1024), 20000))]


def stub_launches(hopper: bool = False) -> None:
    """Every Triton launch a no-op (counted in LAUNCHES), and the CUDA tests true for CPU tensors;
    with ``hopper`` the Hopper test too, so that the calls take the Gluon kernels' host paths (the
    H200's: their descriptors, splits and slices; the launches are no-ops all the same)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/, when imported from elsewhere
    from step_ops import stub_kernels  # noqa: PLC0415

    stub_kernels(LAUNCHES, hopper=hopper)


def sync() -> None:
    if DEVICE == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, n=50) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(3):  # best of three rounds: a loaded host's stalls are not the code's cost
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
        sync()
    return best / n * 1e6


def gpu_us(fn, n=50) -> float:
    """Kernel µs per call from the profiler (every CUDA kernel's time, summed)."""
    return kernel_events(fn, n)[1]


def top(fn, k: int) -> str:
    fn()
    sync()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        fn()
    pr.disable()
    sync()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(k)
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(k)
    return s.getvalue()


def timeline(fn, n: int = 40) -> list[tuple[str, float]]:
    """[(marks "a → b", mean host µs per call between them)] of ``fn``'s calls run back to back (the
    GPU, slower than the host or not, keeps no long queue: launches cost what they cost in use).
    Marks: each call's start and end, the chunk op's autograd Function (entry and exit of its forward
    and backward) and every chunk-kernel launch (:func:`gdn.ops.triton.launch.launch`, by kernel).
    The gaps are gdn's own code, torch's ops and the autograd engine; a launch's span is gdn's
    launch code, Triton's binder and the launcher."""
    from gdn.ops.delta.triton import chunk as C  # noqa: PLC0415
    from gdn.ops.triton import launch as L  # noqa: PLC0415

    ev, pc, patched = [], time.perf_counter, []

    def mark(label):
        ev.append((label, pc()))

    def patch(obj, name, new):
        patched.append((obj, name, obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)))
        setattr(obj, name, new)

    real = L.launch
    fn()  # every module that launches is imported (some on first use) before their launch is marked
    sync()

    def launch(kernel, grid, *args, **meta):
        name = kernel.fn.__name__.removesuffix("_kernel")
        mark(name + ">")
        out = real(kernel, grid, *args, **meta)
        mark("<" + name)
        return out

    for mod in list(sys.modules.values()):
        if getattr(mod, "launch", None) is real and mod is not L:
            patch(mod, "launch", launch)
    fwd0, bwd0 = C.ChunkFunction.forward, C.ChunkFunction.backward

    def fwd(ctx, *args):
        mark("Function.forward>")
        out = fwd0(ctx, *args)
        mark("<Function.forward")
        return out

    def bwd(ctx, *args):
        mark("Function.backward>")
        out = bwd0(ctx, *args)
        mark("<Function.backward")
        return out

    patch(C.ChunkFunction, "forward", staticmethod(fwd))
    patch(C.ChunkFunction, "backward", staticmethod(bwd))

    def call():
        mark("call>")
        fn()
        mark("<call")

    try:
        for _ in range(3):
            call()
        sync()
        ev.clear()
        for _ in range(n):
            call()
        sync()
    finally:
        for obj, name, old in reversed(patched):
            setattr(obj, name, old)
    acc: dict = {}
    for (a, ta), (b, tb) in zip(ev, ev[1:]):
        if a != "<call":
            acc[f"{a} → {b}"] = acc.get(f"{a} → {b}", 0.0) + tb - ta
    return [(k, t / n * 1e6) for k, t in acc.items()]


def launch_table(B: int, T: int, H: int, HV: int, n: int = 300) -> None:
    """Print, for every launch of one forward + backward at (B, T, H, HV, D) bf16 (as recorded by
    :func:`gdn.ops.triton.launch.recording`; a pass with several pipeline candidates records each),
    the host µs per launch through Triton's path and through the compiled kernel's launcher."""
    import triton  # noqa: PLC0415
    import triton.language as tl  # noqa: PLC0415

    from gdn.ops.delta.triton import chunk, chunk_bwd  # noqa: PLC0415
    from gdn.ops.triton import common  # noqa: PLC0415
    from gdn.ops.triton import launch as launcher  # noqa: PLC0415

    @triton.jit
    def one_arg(x):
        tl.store(x, 1.0)

    dev = torch.device("cuda")
    q = torch.randn(B * T, H, D, device=dev, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn(B * T, HV, D, device=dev, dtype=torch.bfloat16)
    g = -torch.rand(B * T, HV, device=dev)
    beta = torch.rand(B * T, HV, device=dev)
    ch = common.make_chunks(B, T, None, dev)
    scale = D ** -0.5
    pl = {}  # (the forward's chunk bounds and warm-up counts, handed on as the autograd node does)
    _, _, ai, gam = chunk._forward(q, k, v, g, beta, None, ch, False, scale, q.dtype, plans=pl)  # compiled, run once
    chunk_bwd.backward(q, k, v, g, beta, None, v, None, ch, scale, ai, q.dtype, gam, plans=pl)
    torch.cuda.synchronize()
    pl = {}
    with launcher.recording() as launches:
        _, _, ai, gam = chunk._forward(q, k, v, g, beta, None, ch, False, scale, q.dtype, plans=pl)
        chunk_bwd.backward(q, k, v, g, beta, None, v, None, ch, scale, ai, q.dtype, gam, plans=pl)
    stream = torch.cuda.current_stream().cuda_stream
    x = torch.zeros(1, device=dev)
    rows = [("one-argument kernel", 1, host_us(lambda: one_arg[(1,)](x), n), None),
            ("torch.empty(1 MB)", 0, host_us(lambda: torch.empty(1 << 18, device=dev), n), None),
            ("x.add_(1)", 0, host_us(lambda: x.add_(1), n), None)]
    for kernel, _, args, meta in launches:
        def via_triton(kernel=kernel, args=args, meta=meta):
            kernel[(1,)](*args, **meta)

        ck = kernel[(1,)](*args, **meta)  # the compiled kernel (compiled on the recording's first run)
        bound, _, _ = kernel.device_caches[torch.cuda.current_device()][4](*args, **meta)
        vals = tuple(bound.values())

        def direct(ck=ck, vals=vals):
            ck.run(1, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *vals)

        label = f"{kernel.fn.__name__} (stages {meta.get('num_stages')})"
        rows.append((label, len(args), host_us(via_triton, n), host_us(direct, n)))
    print(f"\nhost µs per launch, {n} back to back, best of 3 rounds (one-program grids), "
          f"at ({B}, {T}, H={H}, HV={HV}, {D}) bf16; {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    print("| launch | run-time args | Triton's path µs | compiled kernel's launcher µs |")
    print("|---|---:|---:|---:|")
    for label, nargs, t, d in rows:
        print(f"| {label} | {nargs} | {t:.1f} | {'' if d is None else f'{d:.1f}'} |")
    # where Triton's path spends a launch: the launch with the most arguments, profiled
    kernel, _, args, meta = max(launches, key=lambda r: len(r[2]))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        kernel[(1,)](*args, **meta)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
    print(f"\n{kernel.fn.__name__} through Triton's path, {n} launches, own time per function (cProfile; "
          f"its overhead inflates every figure alike):\n{s.getvalue()}")


def launch_ab(fwd, fwd_bwd, rounds: int = 5, n: int = 30) -> None:
    """Print host µs per call (each call started with the GPU idle: the time to queue its work, the
    median of ``n``) and wall µs (``do_bench``'s median) of the forward and the forward + backward,
    launching through Triton's own path (``kernel[grid](...)`` every time) and through gdn's
    (:func:`gdn.ops.triton.launch.run`), the two interleaved over ``rounds`` rounds in this process
    (a host's speed drifts between processes and within one)."""
    import statistics  # noqa: PLC0415

    from triton.testing import do_bench  # noqa: PLC0415

    from gdn.ops.triton import launch as L  # noqa: PLC0415

    def tritons(kernel, grid, args, kw, key):
        return kernel[grid](*args, **kw)

    def host(fn):
        ts = []
        for _ in range(n):
            sync()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        sync()
        return statistics.median(ts) * 1e6

    paths, res, real = {"Triton's path": tritons, "gdn's path": L.run}, {}, L.run
    try:
        for _ in range(rounds):
            for name, run in paths.items():
                L.run = run
                for what, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
                    fn()
                    fn()
                    res.setdefault((name, what), []).append((host(fn), do_bench(fn, warmup=20, rep=200,
                                                                                 return_mode="median") * 1e3))
    finally:
        L.run = real
    print(f"\nlaunch paths interleaved, {rounds} rounds: host µs per call (GPU idle at its start, median of {n}) "
          "and wall µs (do_bench median); each round's figure, then the median of the rounds")
    for (name, what), xs in res.items():
        hs, ws = [h for h, _ in xs], [w for _, w in xs]
        print(f"  {name:14s} {what:17s} host {' '.join(f'{h:6.0f}' for h in hs)} -> {statistics.median(hs):6.0f}"
              f" | wall {' '.join(f'{w:6.0f}' for w in ws)} -> {statistics.median(ws):6.0f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8x2048", help="BxT")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--hv", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--cpu-stub", action="store_true", help="CPU tensors, kernel launches as no-ops: gdn's own host time")
    p.add_argument("--hopper", action="store_true",
                   help="with --cpu-stub: the Hopper (H200) host paths, those of the Gluon kernels")
    p.add_argument("--timeline", action="store_true",
                   help="host µs between marks of a forward+backward's calls run back to back (launches by kernel, "
                        "the autograd Function, the engine between them)")
    p.add_argument("--ab", action="store_true",
                   help="(CUDA) host and wall µs per call through Triton's launch path and gdn's, interleaved")
    p.add_argument("--launches", action="store_true",
                   help="(CUDA) host µs per kernel launch, Triton's path against the compiled kernel's launcher")
    p.add_argument("--calibrate", action="store_true",
                   help="host µs of fixed workloads on this machine (to compare hosts' speeds), then exit")
    p.add_argument("--fused", action="store_true",
                   help="the layer's entry instead: gated_delta_rule_fused from raw q, k, a, b (the prologue's "
                        "L2 norms and gates too)")
    p.add_argument("--config", default=None, metavar="JSON",
                   help="launch overrides first (a file or inline JSON, gdn.ops.tuning.update_from), e.g. "
                        "'{\"fused_rbwd\": {\"on\": true}}'")
    a = p.parse_args(argv)
    from gdn.ops.tuning import apply_config  # noqa: PLC0415

    apply_config(p, a.config)
    if a.calibrate:
        dev = "cuda" if torch.cuda.is_available() and not a.cpu_stub else "cpu"
        name = torch.cuda.get_device_name() if dev == "cuda" else "CPU"
        print(f"host calibration on {name} ({platform.processor() or platform.machine()}), "
              f"Python {platform.python_version()}, torch {torch.__version__}")
        for what, us in calibrate(dev):
            print(f"  {us:8.2f} µs  {what}")
        return 0
    if a.launches:
        if a.cpu_stub or not torch.cuda.is_available():
            p.error("--launches needs CUDA (and no --cpu-stub)")
        B, T = (int(x) for x in a.shape.lower().split("x"))
        launch_table(B, T, a.heads, a.hv)
        return 0
    if a.cpu_stub and argv is None:  # (run as a script: a caller's own process is left as it is)
        heap_allocations()
        stub_launches(a.hopper)
    B, T = (int(x) for x in a.shape.lower().split("x"))
    xs, _ = inputs(B, T, a.heads, a.hv, None, device=DEVICE)
    do = torch.randn(B, T, a.hv, D, device=DEVICE, dtype=torch.bfloat16)
    fwd = gdn_fn(xs, None)
    if a.fused:  # a, b: the decay's and β's pre-activations; A_log, dt_bias: per value head
        from gdn.ops import gated_delta_rule_fused  # noqa: PLC0415

        q, k, v = xs[:3]
        ab = [torch.randn(B, T, a.hv, device=DEVICE, dtype=torch.bfloat16).requires_grad_() for _ in range(2)]
        params = [torch.zeros(a.hv, device=DEVICE, requires_grad=True) for _ in range(2)]
        xs = [q, k, v, *ab, *params]

        def fwd():
            return gated_delta_rule_fused(q, k, v, *ab, *params, backend="triton")[0]

    def fwd_nograd():
        with torch.no_grad():
            return fwd()

    def fwd_bwd():
        for x in xs:
            x.grad = None
        fwd().backward(do)

    where = (f"CPU, launches stubbed, freed blocks {'kept in the heap' if heap_kept() else 'returned by glibc'}"
             if a.cpu_stub else torch.cuda.get_device_name())
    print(f"{'gated_delta_rule_fused' if a.fused else 'gated_delta_rule'}, shape ({B}, {T}, H={a.heads}, "
          f"HV={a.hv}, {D}) bf16; torch {torch.__version__}, {where}")
    if a.ab:
        if a.cpu_stub or not torch.cuda.is_available():
            p.error("--ab needs CUDA (and no --cpu-stub)")
        launch_ab(fwd_nograd, fwd_bwd)
        return 0
    if a.timeline:
        rows = timeline(fwd_bwd)
        print("\nforward+backward, calls back to back: host µs per call between marks")
        for k, us in rows:
            print(f"  {us:8.1f}  {k}")
        print(f"  {sum(us for _, us in rows):8.1f}  in all")
        return 0
    for name, fn in (("forward, no grad", fwd_nograd), ("forward", fwd), ("forward+backward", fwd_bwd)):
        if a.cpu_stub:
            fn()
            LAUNCHES.clear()
            fn()
            n = sum(LAUNCHES.values())
            print(f"{name:18s} host {host_us(fn):8.1f} µs/call   ({n} launches)")
        else:
            print(f"{name:18s} host {host_us(fn):8.1f} µs/call   GPU kernels {gpu_us(fn):8.1f} µs/call")
    for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        print(f"\n== {name}: own host time, 20 calls\n{top(fn, a.top)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
