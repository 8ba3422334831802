"""The Python host time of one launch on gdn's launch path (gdn.ops.triton.launch: the launch
settings, the key of every argument, the cached launcher, the tensor maps from their cache), without
a GPU: fused_bwd's launch at (8, 2048, 16, 128) bf16 (34 arguments, twelve Gluon tensor descriptors)
with CPU tensors, the compiled kernel faked and the C launch function a no-op behind triton 3.6's own
descriptor wrapper, so that everything but the driver call runs as on CUDA.

    python tools/launch_key_cpu.py [--rounds 60] [--calls 200]

Prints the best of ``rounds`` rounds of ``calls`` launches, in µs per launch (the development CPU
drifts between rounds; the minimum is the steadiest figure).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def fake_launch(calls: list):
    """(a kernel whose first launch returns a compiled kernel with a triton-3.6-shaped launcher, the
    launch arguments, the keywords) for fused_bwd at (8, 2048, 16, 128) bf16 on CPU tensors."""
    import triton.backends.nvidia.driver as drv

    from gdn.ops.delta.triton import fused_bwd as fb
    from gdn.ops.tuning import DELTA

    T, H, HV, K, V = 8 * 2048, 16, 16, 128, 128
    bf = torch.bfloat16
    q, k = torch.empty(T, H, K, dtype=bf), torch.empty(T, H, K, dtype=bf)
    v, do, dd, vn = (torch.empty(T, HV, V, dtype=bf) for _ in range(4))
    G, beta = torch.empty(T, HV), torch.empty(T, HV)
    Ai = torch.empty(T, HV, 64, dtype=bf)
    h, dh = torch.empty(256, HV, K, V, dtype=bf), torch.empty(256, HV, K, V, dtype=bf)
    DQ, DK = torch.empty(T, HV, K, dtype=bf), torch.empty(T, HV, K, dtype=bf)
    DB, DG = torch.empty(T, HV), torch.empty(T, HV)
    cu, co = torch.zeros(9, dtype=torch.int32), torch.zeros(9, dtype=torch.int32)
    ci = torch.zeros(256, 2, dtype=torch.int32)
    DT = fb.gl.bfloat16
    d_t, do_t, dd_t, v_t = (fb._tiles(x, T, (64, 128), DT) for x in (vn, do, dd, v))
    h_t, dh_t = (fb._tiles(x, x.numel() // V, (K, 128), DT) for x in (h, dh))
    q_t, k_t, dq_t, dk_t = (fb._tiles(x, T, (64, K), DT) for x in (q, k, DQ, DK))
    ai_t = fb._tiles(Ai, T, (64, 64), DT)
    args = (q_t, k_t, G, beta, ai_t, d_t, do_t, dd_t, v_t, h_t, dh_t, DQ, DK, dd, dq_t, dk_t, dd_t, DB, DG, cu, ci, co,
            0.088, H, HV, 256 * HV)
    meta = dict(K=K, V=V, BV=128, NS=DELTA["fused_bwd"]["NS"], DT=DT, QK_TMA=True, DV_TMA=True,
                PER=DELTA["fused_bwd"]["items"])
    kernel = fb.fused_bwd_kernel
    sig = {p.name: ("tensordesc<bf16[64, 128]>" if p.name.endswith("_t") else "*bf16") for p in kernel.params}
    metas = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[64, 128], fp4_padded=False)] * 12
    wrapped = drv.wrap_handle_tensordesc(lambda *a: calls.append(len(a)), sig, metas)

    class Launcher:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid, launch_pdl = False, False
        launch = staticmethod(wrapped)

    class Compiled:
        function, packed_metadata, run = "fn", "meta", Launcher()

    class Kernel:
        device_caches: dict = {}
        params = kernel.params

        def __getitem__(self, grid):
            return lambda *a, **kw: Compiled()

    return Kernel(), args, meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.calls < 1:
        print("launch_key_cpu.py: --rounds and --calls must be positive", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_INTERPRET", "0")
    import triton.backends.nvidia.driver as drv

    from gdn.ops.triton import launch as L

    # the CUDA-only pieces faked: device, stream, the tensor map's encoding (a list of the same length)
    drv.make_tensordesc_arg = lambda d, meta: [("map", d.base.data_ptr()), *d.shape, *d.strides]
    L.INTERPRET, L._DIRECT_LAYOUT = False, True
    torch.cuda.current_device = lambda: 0
    L._stream = lambda dev: 0
    calls: list = []
    kernel, args, meta = fake_launch(calls)

    def one():
        L.launch(kernel, (256 * 16,), *args, name="fused_bwd", **meta)

    one()
    one()
    best = float("inf")
    for _ in range(a.rounds):
        t = time.perf_counter()
        for _ in range(a.calls):
            one()
        best = min(best, (time.perf_counter() - t) / a.calls)
    print(f"fused_bwd's launch on gdn's path, C launch faked: {best * 1e6:.2f} µs of Python per launch "
          f"(best of {a.rounds} rounds of {a.calls}; {calls[-1]} arguments reached the C function)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
