"""KDA forward + backward in fp16 with intra_bwd capped at 128 registers (the default: 12 + 12 B of
spills, four programs a multiprocessor) against uncapped (142 registers, no spills, three) and
against eight warps capped at 128 (no spills, two programs of eight warps: the same warps a
multiprocessor as the default; ptxas sm_90), in one process, two rounds each, and the largest
difference between each form's outputs and gradients and the capped form's (relative to each
tensor's largest magnitude). GPU only:

    python tools/kda_fp16_cap.py
"""
from __future__ import annotations

import copy
import os
import sys

import torch
import triton

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from gdn import ops  # noqa: E402
from gdn.ops import tuning  # noqa: E402
from kda_gpu import make_inputs  # noqa: E402

FORMS = (("capped", {"kda.intra_bwd": {"fp16": {"PREC": "tf32x3", "stages": [[1, {"maxnreg": 128}]]}}}),
         ("uncapped", {"kda.intra_bwd": {"fp16": {"PREC": "tf32x3", "stages": [1]}}}),
         ("8 warps capped", {"kda.intra_bwd": {"fp16": {"PREC": "tf32x3", "num_warps": 8,
                                                          "stages": [[1, {"maxnreg": 128}]]}}}))


def main() -> int:
    if not torch.cuda.is_available():
        print("kda_fp16_cap: needs CUDA", file=sys.stderr)
        return 2
    for B, T in ((8, 2048), (4, 8192)):
        x, do = make_inputs(B, T, 16, 16, 128, "cuda", torch.float16)
        ins = [x[n] for n in ("q", "k", "v", "g", "beta")]
        outs = {}
        saved = copy.deepcopy(tuning.TABLES)
        for _ in range(2):
            for name, cfg in FORMS:
                tuning.restore(saved)  # each form from the defaults (an update only adds to them)
                tuning.update(cfg)

                def step():
                    ops.kimi_delta_attention(*ins, backend="triton")[0].backward(do)

                step()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(step, grad_to_none=ins, rep=300)
                for t in ins:
                    t.grad = None
                o = ops.kimi_delta_attention(*ins, backend="triton")[0]
                o.backward(do)
                outs[name] = [o.detach().float()] + [t.grad.float() for t in ins]
                for t in ins:
                    t.grad = None
                print(f"({B}, {T}) fp16 fwd+bwd {name}: {ms:.3f} ms", flush=True)
        for name, _ in FORMS[1:]:
            d = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-9)).item()
                    for a, b in zip(outs[name], outs["capped"]))
            print(f"({B}, {T}) max rel diff {name} vs capped: {d:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
