"""GPU validation of the Triton KDA kernels against the float64 chunk form (fp32 and bf16, outputs,
states, all gradients) and their speed next to the PyTorch chunk form. Run on a CUDA machine from the
repository root: ``PYTHONPATH=. python tests/compat/_kda_gpu_check.py`` (not collected by pytest).
Ends with ``KDA GPU check: PASS`` or the errors over their bound (relative error ≤ 1e-4 in fp32,
≤ 5e-2 in bf16, whose inputs are rounded) and exit status 1. The comparison with FLA's KDA is in
``benchmarks/kda_gpu.py``."""

import sys

import torch
import triton

from gdn.ops.kda import chunk as C
from gdn.ops.kda.triton import recurrent as TK


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


BOUND = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
NAMES = "o S dq dk dv dg db dh0".split()
failures = []
torch.manual_seed(0)
dev = "cuda"
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
for (B, T, H, HV, K, V) in [(2, 300, 2, 4, 128, 128), (1, 777, 4, 8, 64, 100), (3, 1, 2, 4, 128, 128),
                            (1, 200, 1, 2, 256, 128)]:
    q = torch.randn(B, T, H, K, device=dev)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1)
    v = torch.randn(B, T, HV, V, device=dev)
    g = -torch.rand(B, T, HV, K, device=dev) * 0.5
    b = torch.rand(B, T, HV, device=dev)
    h0 = torch.randn(B, HV, K, V, device=dev)
    wo, ws = torch.randn(B, T, HV, V, device=dev), torch.randn(B, HV, K, V, device=dev)
    xs = [x.double().requires_grad_() for x in (q, k, v, g, b, h0)]
    o_r, S_r = C.kimi_delta_attention(*xs[:5], initial_state=xs[5], output_final_state=True)
    gr = torch.autograd.grad((o_r * wo).sum() + (S_r * ws).sum(), xs)
    for dt in (torch.float32, torch.bfloat16):
        ys = [x.to(dt).requires_grad_() for x in (q, k, v, g, b)] + [h0.clone().requires_grad_()]
        res = {}
        for name, fn in (("triton", TK.kimi_delta_attention), ("chunk", C.kimi_delta_attention)):
            o, S = fn(*ys[:5], initial_state=ys[5], output_final_state=True)
            gt = torch.autograd.grad((o.float() * wo).sum() + (S * ws).sum(), ys)
            res[name] = [rel(o, o_r), rel(S, S_r)] + [rel(a, r) for a, r in zip(gt, gr)]
        print((B, T, H, HV, K, V), dt, " ".join(NAMES))
        for name, errs in res.items():
            print(f"  {name:6s}", " ".join(f"{e:.1e}" for e in errs))
            failures += [f"{name} {dt} {(B, T, H, HV, K, V)} {n}: {e:.1e} > {BOUND[dt]:.0e}"
                         for n, e in zip(NAMES, errs) if not e <= BOUND[dt]]

B, T, HV, K, V = 4, 4096, 16, 128, 128
q = torch.randn(B, T, HV, K, device=dev, dtype=torch.bfloat16)
k = torch.nn.functional.normalize(q.float(), dim=-1).bfloat16()
v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
g = (-torch.rand(B, T, HV, K, device=dev) * 0.1).bfloat16()
b = torch.rand(B, T, HV, device=dev, dtype=torch.bfloat16)
for name, fn in (("triton", TK.kimi_delta_attention), ("chunk", C.kimi_delta_attention)):
    ms = triton.testing.do_bench(lambda: fn(q, k, v, g, b), warmup=3, rep=20)
    print(f"fwd {name} B={B} T={T} HV={HV} K=V=128 bf16: {ms:.2f} ms")
s1 = torch.randn(64, HV, K, V, device=dev)
q1, k1, v1 = q[:1, :1].expand(64, 1, HV, K).contiguous(), k[:1, :1].expand(64, 1, HV, K).contiguous(), v[:1, :1].expand(64, 1, HV, V).contiguous()
g1, b1 = g[:1, :1].expand(64, 1, HV, K).contiguous(), b[:1, :1].expand(64, 1, HV).contiguous()
ms = triton.testing.do_bench(lambda: TK.kimi_delta_attention(q1, k1, v1, g1, b1, initial_state=s1, output_final_state=True))
print(f"decode step triton N=64 HV={HV} K=V=128: {ms * 1000:.0f} us")
print("KDA GPU check: " + ("PASS" if not failures else "FAIL\n  " + "\n  ".join(failures)))
sys.exit(1 if failures else 0)
