"""How wide the glue kernels' global loads and stores compile at a model's layouts (sm_90 PTX).

The glue kernels read the joined input projection's column blocks in place (the short convolutions'
q, k and v, the gated norm's gate, SwiGLU's gate and up) and write their gradients back there. In 16
bits an access goes out as a 16-byte vector only when the compiler can prove the run is contiguous
and starts on 16 bytes: a row offset from a division per element, a block that starts off 16 bytes,
or a stride the kernel does not specialise (``do_not_specialize``) all give one 2-byte access per
element: about five times the bytes' time for SwiGLU's backward at the 340m training shapes. This
runs one forward and backward of a model on CPU tensors with every Triton launch captured instead of
run (tools/ptx_fingerprint.py), compiles each distinct glue launch for sm_90 and counts its global
accesses by width, so a layout or kernel change can be checked without a GPU:

    python tools/vector_access.py [--preset gdn --size 340m] [--kernels 'norm|swiglu|conv']

One line per distinct launch: the kernel, then its loads and stores by PTX opcode and count
(``ld.global.b16`` is a 2-byte access, ``ld.global.v4.b32`` a 16-byte one).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

OPS = re.compile(r"\b((?:ld|st)\.global[.a-z0-9]*)\s")


def accesses(ptx: str) -> Counter:
    """{PTX global load/store opcode: count} of one kernel's PTX."""
    return Counter(OPS.findall(ptx))


def glue_launches(preset: str, size: str, tokens: int, pattern: str, layers: int = 2) -> list[tuple[str, Counter]]:
    """[(kernel name, :func:`accesses`)] of each distinct launch of a kernel whose name matches
    ``pattern`` in one forward + backward of ``preset``/``size`` (``layers`` of them) on ``tokens``
    tokens, bf16, compiled for sm_90."""
    import torch
    from triton.backends.nvidia.compiler import CUDABackend

    from gdn.models import GDNConfig, GDNForCausalLM
    from tools import ptx_fingerprint as P

    cfg = GDNConfig.from_preset(preset, size, num_hidden_layers=layers)
    model = GDNForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    with P.captured() as launches:
        model(input_ids=ids, labels=ids).loss.backward()
    backend, binders, seen, out = CUDABackend(P.TARGET), {}, set(), []
    for kernel, args, kw in launches:
        name = getattr(getattr(kernel, "fn", None), "__name__", str(kernel))
        if not re.search(pattern, name):
            continue
        key, inputs = P.launch_key(kernel, args, kw, backend, binders)
        if key in seen:
            continue
        seen.add(key)
        out.append((name, accesses(P.compile_launch(inputs).asm["ptx"])))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gdn")
    ap.add_argument("--size", default="340m")
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the captured call (layouts do not depend on it)")
    ap.add_argument("--kernels", default="norm|swiglu|conv", help="regex of the kernel names to compile")
    args = ap.parse_args(argv)
    for name, acc in glue_launches(args.preset, args.size, args.tokens, args.kernels):
        print(f"{name}: " + ", ".join(f"{op} {n}" for op, n in sorted(acc.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
