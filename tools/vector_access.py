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

``--loops`` prints instead, per distinct launch, the global loads (L) and stores (S) before its
largest loop and in it, in SASS order, as runs (``L8 S4``): a loop that stores and then loads waits,
at each iteration, for its loads after its stores, since no load moves above an earlier store the
compiler cannot prove disjoint (docs/DESIGN.md §5). A loop that requests the next iteration's rows
first has no load after a store in its body and the first iteration's loads before it.
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


SASS_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s*(.*?);")


def loop_accesses(sass: str) -> tuple[list[str], list[str]]:
    """(before, body): the global loads ("L") and stores ("S") of one kernel's SASS (cuobjdump's,
    each instruction at its address) before its largest loop and in that loop (a branch back to an
    earlier address and the instructions from there to it), in order; ([], []) without a loop."""
    ins = [(int(a, 16), t) for a, t in SASS_INSTR.findall(sass)]
    best = None
    for addr, txt in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr and (best is None or addr - int(m.group(1), 16) > best[1] - best[0]):
            best = (int(m.group(1), 16), addr)
    if best is None:
        return [], []

    def acc(part):
        return [m.group(1)[0] for t in part for m in [re.search(r"\b(LDG|STG)\.", t)] if m]

    return (acc(t for a, t in ins if a < best[0]), acc(t for a, t in ins if best[0] <= a <= best[1]))


def requests_ahead(before: list[str], body: list[str]) -> bool:
    """Whether a loop (:func:`loop_accesses`) requests its rows an iteration ahead: no load after a
    store within an iteration, and as many loads before the loop as in it (the first iteration's
    rows requested there, each iteration's loads being the next one's)."""
    late = "S" in body and "L" in body[body.index("S"):]
    return not late and before.count("L") >= body.count("L") > 0


def runs(seq: list[str]) -> str:
    """``["L", "L", "S"]`` → ``"L2 S1"``."""
    out = []
    for x in seq:
        if out and out[-1][0] == x:
            out[-1][1] += 1
        else:
            out.append([x, 1])
    return " ".join(f"{x}{n}" for x, n in out)


def glue_loops(preset: str, size: str, tokens: int, pattern: str, layers: int = 2) -> list[tuple]:
    """[(kernel name, its compile-time settings, *:func:`loop_accesses`)] of each distinct launch of
    a kernel whose name matches ``pattern`` in one forward + backward of ``preset``/``size``
    (``layers`` of them) on ``tokens`` tokens, bf16, compiled for sm_90 and disassembled."""
    from tools.gluon_budget import sass

    return [(name, kw, *loop_accesses(sass(k.asm["cubin"]))) for name, kw, k in _compiled(preset, size, tokens,
                                                                                              pattern, layers)]


def _compiled(preset: str, size: str, tokens: int, pattern: str, layers: int):
    """(kernel name, compile-time settings, compiled kernel) of each distinct matching launch of one
    forward + backward (:func:`glue_launches`'s)."""
    import torch
    from triton.backends.nvidia.compiler import CUDABackend

    from gdn.models import GDNConfig, GDNForCausalLM
    from tools import ptx_fingerprint as P

    cfg = GDNConfig.from_preset(preset, size, num_hidden_layers=layers)
    model = GDNForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    with P.captured() as launches:
        model(input_ids=ids, labels=ids).loss.backward()
    backend, binders, seen = CUDABackend(P.TARGET), {}, set()
    for kernel, args, kw in launches:
        name = getattr(getattr(kernel, "fn", None), "__name__", str(kernel))
        if not re.search(pattern, name):
            continue
        key, inputs = P.launch_key(kernel, args, kw, backend, binders)
        if key in seen:
            continue
        seen.add(key)
        yield name, {k: v for k, v in kw.items() if isinstance(v, (bool, int))}, P.compile_launch(inputs)


def glue_launches(preset: str, size: str, tokens: int, pattern: str, layers: int = 2) -> list[tuple[str, Counter]]:
    """[(kernel name, :func:`accesses`)] of each distinct launch of a kernel whose name matches
    ``pattern`` in one forward + backward of ``preset``/``size`` (``layers`` of them) on ``tokens``
    tokens, bf16, compiled for sm_90."""
    return [(name, accesses(k.asm["ptx"])) for name, _, k in _compiled(preset, size, tokens, pattern, layers)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gdn")
    ap.add_argument("--size", default="340m")
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the captured call (layouts do not depend on it)")
    ap.add_argument("--kernels", default="norm|swiglu|conv", help="regex of the kernel names to compile")
    ap.add_argument("--loops", action="store_true", help="the loads and stores of each kernel's loop, in order")
    args = ap.parse_args(argv)
    if args.loops:
        for name, kw, before, body in glue_loops(args.preset, args.size, args.tokens, args.kernels):
            print(f"{name} {kw}: before the loop {runs(before) or '-'}, in it {runs(body) or 'no loop'}"
                  f"{' (rows requested ahead)' if requests_ahead(before, body) else ''}")
        return 0
    for name, acc in glue_launches(args.preset, args.size, args.tokens, args.kernels):
        print(f"{name}: " + ", ".join(f"{op} {n}" for op, n in sorted(acc.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
