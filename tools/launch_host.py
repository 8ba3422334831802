"""Host time of the chunk kernels' launches on a CUDA machine: per kernel of one gated delta rule
forward + backward at (8, 2048, 16, 128) bf16, the time Triton's argument binder would take (the
specialisation of every argument: for a tensor descriptor it formats the descriptor's type with its
shared-memory layout) and of gdn's whole launch (gdn.ops.triton.launch.run: its own key of the
arguments, the cache lookup and the compiled kernel's launcher, which encodes each descriptor's
tensor map); and a few of the pieces one at a time.

    python tools/launch_host.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from gdn import ops  # noqa: E402
from gdn.ops.delta.triton import fused_bwd  # noqa: E402
from gdn.ops.triton import launch as L  # noqa: E402


def micro(name, f, n=2000):
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    print(f"{name}: {(time.perf_counter() - t) / n * 1e6:.2f} us", flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    dev = "cuda"
    B, T, H, HV, K, V = 8, 2048, 16, 16, 128, 128
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, device=dev) + 3)
    beta = torch.rand(B, T, HV, device=dev).sigmoid()
    q, k, v, g, beta = (t.requires_grad_() for t in (q, k, v, g, beta))

    def step():
        ops.gated_delta_rule(q, k, v, g, beta, backend="triton")[0].sum().backward()

    step()
    torch.cuda.synchronize()
    x = torch.empty(B * T, HV, 64, device=dev, dtype=torch.bfloat16)
    d = fused_bwd._tiles(x, B * T, (64, 64), gl.bfloat16)
    micro("_tiles (a descriptor of a [T, HV, 64] tensor)", lambda: fused_bwd._tiles(x, B * T, (64, 64), gl.bfloat16))
    micro("specialize(descriptor)", lambda: native_specialize_impl(CUDABackend, d, False, True, True))
    micro("specialize(tensor)", lambda: native_specialize_impl(CUDABackend, x, False, True, True))
    micro("specialize(int)", lambda: native_specialize_impl(CUDABackend, 16, False, True, True))
    micro("repr(layout)", lambda: repr(d.layout))
    micro("gdn's key of a descriptor", lambda: L._arg_key(d, False))
    acc = {}
    orig = L.run

    def run(kernel, grid, args, kw, key):
        index = torch.cuda.current_device()
        t = time.perf_counter()
        kernel.device_caches[index][4](*args, **kw)
        t1 = time.perf_counter()
        r = orig(kernel, grid, args, kw, key)
        t2 = time.perf_counter()
        a = acc.setdefault(kernel.fn.__name__, [0, 0.0, 0.0])
        a[0] += 1
        a[1] += t1 - t
        a[2] += t2 - t1
        return r

    L.run = run
    try:
        for _ in range(50):
            step()
        torch.cuda.synchronize()
    finally:
        L.run = orig
    for name, (n, b, r) in acc.items():
        print(f"{name}: Triton's binder {b / n * 1e6:.1f} us, gdn's run (key + launch) {r / n * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
