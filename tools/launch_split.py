"""Where a launch's host time goes on gdn's launch path (gdn.ops.triton.launch.run), per kernel of a
gated delta rule forward + backward at (8, 2048, 16, 128) bf16 (benchmarks/ops_gpu.py's inputs):
launches per call, µs per launch in ``launch.run`` (the key of the arguments, the lookup, the
launch) and in the cached launcher's call alone (``go``: descriptors swapped for their encoded tensor
maps, then the C launch function), and tensor maps encoded per call after three warm-up calls (0
where the map cache holds them all). Also whether each kernel's launcher was unwrapped (its C
function called with the maps, :func:`gdn.ops.triton.launch._unwrap_descriptors`). Each call starts
with the GPU idle.

    python tools/launch_split.py
"""
import collections
import os
import sys
import time
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch
from ops_gpu import inputs, gdn_fn
from gdn.ops.triton import launch as L


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    import triton.backends.nvidia.driver as drv
    xs, cu = inputs(8, 2048, 16, 16, None)
    f = gdn_fn(xs, cu)
    do = torch.randn_like(f())
    def fb():
        for x in xs: x.grad = None
        f().backward(do)
    for _ in range(3): fb()
    torch.cuda.synchronize()
    pc = time.perf_counter
    acc = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
    real_run, real_enc = L.run, drv.make_tensordesc_arg
    cur = [None]
    def enc(d, m):
        acc[cur[0]][3] += 1
        return real_enc(d, m)
    drv.make_tensordesc_arg = enc
    # wrap the cached go functions
    for k, (ck, go) in list(L._LAUNCHERS.items()):
        name = k[0][0].fn.__name__
        def wgo(*a, go=go, name=name):
            t0 = pc(); r = go(*a); acc[name][2] += pc() - t0; return r
        L._LAUNCHERS[k] = (ck, wgo)
    print("unwrapped:", {k[0][0].fn.__name__: L._unwrap_descriptors(ck.run.launch) is not None for k, (ck, _) in L._LAUNCHERS.items() if hasattr(ck.run, "launch")})
    def run(kernel, grid, args, kw, key):
        name = kernel.fn.__name__; cur[0] = name
        t0 = pc(); r = real_run(kernel, grid, args, kw, key); acc[name][0] += 1; acc[name][1] += pc() - t0; return r
    L.run = run
    N = 30
    for _ in range(N):
        torch.cuda.synchronize(); fb()
    torch.cuda.synchronize()
    for name, (n, t, g, e) in acc.items():
        print(f"{name:22s} launches/call {n / N:.0f}  run µs {t / n * 1e6:7.1f}  go µs {g / n * 1e6:7.1f}  encodes/call {e / N:.1f}")
    print("maps cached", len(L._MAPS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
