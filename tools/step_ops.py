"""The host's work in one training step of a preset, counted: kernel launches of gdn's Triton
kernels (by kernel) and PyTorch operator calls (by ATen operator), per layer and for the whole
model, on the CPU with every Triton launch replaced by a no-op and the CUDA code paths taken (the
kernels' host side, the glue ops' Triton forms, the Hopper forms of the chunk kernels), so the
counts are those a CUDA step issues. A training step whose host time exceeds its GPU time is paid
per operation: this says how many there are and whose they are.

The model is the preset's layer structure (layer kinds, heads, head sizes, gates, convolutions)
at a reduced width so that the CPU runs the step quickly; the counts do not depend on the width,
sequence length or batch (only on the layers), so they are those of the full size:

    python tools/step_ops.py --preset gdn [--size 340m] [--layers 2] [--top 20]

The step is ``benchmarks/train.py``'s: bf16 autocast forward with labels, backward, AdamW
(foreach), gradients set to None. Counting runs the second step (the first creates the optimiser's
state). The AdamW operators on its CPU step counters (``_local_scalar_dense``) are counted too: on
CUDA they read CPU tensors and do not synchronise.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: its interpreter takes CPU tensors

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


def stub_kernels(counts: collections.Counter, hopper: bool = True) -> None:
    """Every Triton launch a no-op counted in ``counts`` by kernel name; gdn's CUDA paths taken on
    CPU tensors (the router's and the glue ops' CUDA test, and with ``hopper`` the Hopper test of
    the Gluon kernels and the H200's 132 multiprocessors, on which the split decisions rest)."""
    import triton.runtime.interpreter as interp
    from triton.runtime.jit import JITFunction

    def getitem(self, grid):
        name = getattr(getattr(self, "fn", None), "__name__", None) or getattr(self, "__name__", "?")

        def run(*args, **kwargs):
            counts[name] += 1
        return run

    JITFunction.__getitem__ = getitem
    interp.InterpretedFunction.__getitem__ = getitem
    import gdn.ops  # noqa: F401  (every module that holds the CUDA test, imported)
    from gdn.ops.delta.triton import fused_bwd, fused_fwd, fused_rbwd, fused_rev

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("gdn.") and hasattr(mod, "use_triton"):
            mod.use_triton = lambda x: True
    if hopper:
        for mod in (fused_bwd, fused_fwd, fused_rbwd, fused_rev):
            mod.hopper = lambda q: True
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("gdn.") and callable(getattr(mod, "sm_count", None)):
                mod.sm_count = lambda device: 132


class OpCounter(TorchDispatchMode):
    """Counts each ATen operator reaching the dispatcher (views included: each costs the host a call)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_step(preset: str, size: str, layers: int, seq_len: int = 128, batch: int = 2):
    """(kernel launches by name, ATen operators by name) of one training step of ``preset`` at the
    layer structure of ``size`` with ``layers`` layers."""
    from gdn.models import GDNConfig, GDNForCausalLM

    launches: collections.Counter = collections.Counter()
    stub_kernels(launches)
    base = GDNConfig.from_preset(preset, size)
    # the width shrunk (heads and head sizes kept: the kernels' paths depend on them), the depth given
    cfg = GDNConfig.from_preset(preset, size, num_hidden_layers=layers, vocab_size=512,
                                hidden_size=min(base.hidden_size, 256),
                                intermediate_size=min(base.intermediate_size, 512))
    torch.manual_seed(0)
    model = GDNForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    launches.clear()
    counter = OpCounter()
    with counter:
        step()
    return launches, counter.counts


def per_layer(counts: collections.Counter, few: collections.Counter, layers: int, few_layers: int) -> dict:
    """Each name's count per layer, from two depths: (counts − few) / (layers − few_layers)."""
    return {k: (counts[k] - few[k]) / (layers - few_layers) for k in counts | few}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gdn")
    ap.add_argument("--size", default="340m")
    ap.add_argument("--layers", type=int, default=2, help="depth counted (the per-layer figures come from it and one less)")
    ap.add_argument("--top", type=int, default=15, help="operators and kernels listed")
    a = ap.parse_args(argv)
    if a.layers < 2:
        print("step_ops.py: --layers must be at least 2 (per-layer figures are differences of two depths)",
              file=sys.stderr)
        return 2
    kern, ops = count_step(a.preset, a.size, a.layers)
    kern1, ops1 = count_step(a.preset, a.size, a.layers - 1)
    k_layer = per_layer(kern, kern1, a.layers, a.layers - 1)
    o_layer = per_layer(ops, ops1, a.layers, a.layers - 1)
    print(f"one training step, preset {a.preset} at {a.size}'s layer structure, {a.layers} layers "
          f"(bf16 autocast, AdamW foreach; torch {torch.__version__})")
    print(f"kernel launches: {sum(kern.values())} in the step, {sum(k_layer.values()):.0f} per layer")
    print(f"ATen operators:  {sum(ops.values())} in the step, {sum(o_layer.values()):.0f} per layer")
    print("\nper layer, kernel launches:")
    for k, v in sorted(k_layer.items(), key=lambda kv: -kv[1])[:a.top]:
        if v:
            print(f"  {v:5.0f}  {k}")
    print("\nper layer, ATen operators:")
    for k, v in sorted(o_layer.items(), key=lambda kv: -kv[1])[:a.top]:
        if v:
            print(f"  {v:5.0f}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
