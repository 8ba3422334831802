"""Count the work of one static decode step (:func:`gdn.models.static_decode_step`), per layer kind.

On CUDA it counts kernels: each block's ``decode_into`` (and the embedding + final norm + head) is
captured alone in a CUDA graph whose kernel nodes are counted from the graph's debug dump, and the
whole step is captured once more as a check that the parts add up; ``--profile`` also counts the
kernels ``torch.profiler`` sees in one eager step. On the CPU it counts the aten ops the step
dispatches, leaving out the ones that only make views (they launch no kernel on a GPU): a proxy.
With ``--triton`` (CPU, under ``TRITON_INTERPRET=1``) the step takes the path it takes on CUDA:
every op that picks Triton for CUDA tensors picks it for the CPU tensors too, and each Triton
launch counts as one op ``triton:<kernel>`` (the aten ops the interpreter itself runs to move
arguments are not counted), so ``--detail`` shows the copies (``clone``, ``copy_``) left on the
GPU path.

    python tools/decode_kernels.py                                  # gdn preset, tiny, CPU
    TRITON_INTERPRET=1 python tools/decode_kernels.py --triton --batch 32 --detail
    python tools/decode_kernels.py --preset gdn --size 340m --batch 32 --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter, defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gdn.generation import prefill  # noqa: E402
from gdn.models import PRESETS, GDNConfig, GDNForCausalLM, StaticCache, static_decode_step  # noqa: E402

#: aten ops that only make views or read metadata or dtypes: no kernel on a GPU.
VIEW_OPS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "split",
            "split_with_sizes", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "unbind", "view_as_real",
            "view_as_complex", "_reshape_alias", "narrow", "lift_fresh", "unflatten", "flatten", "chunk",
            "view_as", "expand_as", "sym_size", "sym_stride", "sym_numel", "dim", "is_contiguous", "size",
            "stride", "numel", "_local_scalar_dense", "movedim", "prim", "promote_types"}


#: aten ops that only allocate: no kernel on a GPU either (the Triton path allocates its outputs).
ALLOC_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched under ``label`` (set by the caller between parts of the step)."""

    def __init__(self):
        super().__init__()
        self.label = "head"
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.paused = False  # inside an interpreted Triton launch: its argument copies are no kernels

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in VIEW_OPS and name not in ALLOC_OPS and not self.paused:
            self.counts[self.label][name] += 1
        return func(*args, **(kwargs or {}))

    def launch(self, name: str) -> None:
        """Count one kernel launch ``name`` under the current label."""
        self.counts[self.label][name] += 1


def triton_on_cpu(counter: OpCounter) -> None:
    """Send the ops to their Triton kernels for CPU tensors (the interpreter runs them) and count
    each launch as one op ``triton:<kernel>`` in ``counter``. Needs ``TRITON_INTERPRET=1`` before
    Triton is imported; lasts for the process."""
    from gdn.ops import router
    from gdn.ops.tuning import INTERPRET
    if not (router.HAS_TRITON and INTERPRET):
        raise SystemExit("--triton needs Triton and TRITON_INTERPRET=1 in the environment")
    from triton.runtime.interpreter import InterpretedFunction

    def on_cpu(x):
        return router.HAS_TRITON

    original = router.use_triton
    for mod in list(sys.modules.values()):  # the router and every module that imported its use_triton
        if getattr(mod, "__name__", "").startswith("gdn.") and getattr(mod, "use_triton", None) is original:
            mod.use_triton = on_cpu
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        if kwargs.get("warmup"):
            return run(self, *args, **kwargs)
        counter.launch(f"triton:{self.fn.__name__}")
        counter.paused = True
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.paused = False

    InterpretedFunction.run = counted


def block_kinds(model) -> list[str]:
    """The layer-pattern letter of every block."""
    return list(model.config.layer_pattern)


def cpu_counts(model, cache, tokens, triton: bool = False) -> tuple[dict[str, int], dict[str, Counter]]:
    """Non-view aten ops of one step: per layer kind (ops of one block of that kind) and the rest;
    ``triton``: on the CUDA path, Triton launches counted (:func:`triton_on_cpu`)."""
    counter = OpCounter()
    if triton:
        triton_on_cpu(counter)
    blocks = model.model.layers
    kinds = block_kinds(model)
    originals = [b.decode_into for b in blocks]

    def labelled(i, fn):
        def run(*a, **kw):
            counter.label = f"{kinds[i]}{i}"
            try:
                return fn(*a, **kw)
            finally:
                counter.label = "head"
        return run

    for i, b in enumerate(blocks):
        b.decode_into = labelled(i, originals[i])
    try:
        with torch.no_grad(), counter:
            static_decode_step(model, cache, tokens)
    finally:
        for b in blocks:
            del b.decode_into  # back to the class's method
    per_kind: dict[str, int] = {}
    detail: dict[str, Counter] = {}
    for label, c in counter.counts.items():
        kind = "embed+norm+head" if label == "head" else label[0]
        per_kind.setdefault(kind, sum(c.values()))
        detail.setdefault(kind, c)
    per_kind["step"] = sum(sum(c.values()) for c in counter.counts.values())
    return per_kind, detail


def graph_kernels(fn, table: list | None = None) -> int:
    """Kernels of one replay of a CUDA graph that captures ``fn()`` (after two eager warm-up calls),
    as the profiler records them (copies and sets left out). With ``table`` (a list), appends the
    replay's (GPU µs, kernel name) pairs to it."""
    from torch.profiler import ProfilerActivity, profile as prof
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        g.replay()
        torch.cuda.synchronize()
    kernels = [e for e in p.events() if e.device_type.name == "CUDA"
               and not e.name.lower().startswith(("memcpy", "memset"))]
    if table is not None:
        table.extend((e.device_time, e.name) for e in kernels)
    return len(kernels)


def cuda_counts(model, cache, tokens, profile: bool) -> dict[str, int]:
    """Kernels per layer kind (one block of each), of the embedding + norm + head, of the whole step."""
    blocks = model.model.layers
    kinds = block_kinds(model)
    x = model.get_input_embeddings()(tokens[:, None]).detach()
    out: dict[str, int] = {}
    with torch.no_grad():
        for i, (block, st) in enumerate(zip(blocks, cache.layers)):
            if kinds[i] in out:
                continue
            slot = cache.seen if getattr(st, "window", None) is None else torch.remainder(cache.seen, st.window)
            w = cache.weights.layers[i]
            # with the previous block's MLP output to add, as every block but the first has
            out[kinds[i]] = graph_kernels(lambda: block.decode_into(x, st, slot, cache.positions, w, x))
        def head():
            e = model.get_input_embeddings()(tokens[:, None])
            return model.lm_head(model.model.norm.add_forward(e, e)[1])[:, -1].float()

        out["embed+norm+head"] = graph_kernels(head)
        table: list = []
        out["step"] = graph_kernels(lambda: static_decode_step(model, cache, tokens), table)
        if profile:
            total = sum(t for t, _ in table)
            by: dict = {}
            for t, name in table:
                n, s = by.get(name[:90], (0, 0.0))
                by[name[:90]] = (n + 1, s + t)
            print(f"one replayed step: {len(table)} kernels, {total:.1f} µs of kernel time")
            for name, (n, s) in sorted(by.items(), key=lambda kv: -kv[1][1])[:25]:
                print(f"  {s:8.1f} µs  x{n:<4d} {name}")
            from torch.profiler import ProfilerActivity, profile as prof
            static_decode_step(model, cache, tokens)
            torch.cuda.synchronize()
            with prof(activities=[ProfilerActivity.CUDA]) as p:
                static_decode_step(model, cache, tokens)
                torch.cuda.synchronize()
            out["step (profiler)"] = sum(1 for e in p.events() if e.device_type.name == "CUDA"
                                         and not e.name.lower().startswith(("memcpy", "memset")))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gdn", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--size", default="tiny")
    p.add_argument("--pattern", default=None, help="a layer pattern instead of the preset's (e.g. GDMLKAS)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--detail", action="store_true", help="list the ops of each layer kind (CPU)")
    p.add_argument("--profile", action="store_true", help="also count one eager step's kernels (CUDA)")
    p.add_argument("--triton", action="store_true",
                   help="CPU: take the CUDA path, Triton kernels run by the interpreter (TRITON_INTERPRET=1)")
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    kw = {} if args.pattern is None else {"layer_pattern": args.pattern, "num_hidden_layers": len(args.pattern)}
    if args.pattern is not None and "S" in args.pattern:
        kw["window_size"] = 4
    model = GDNForCausalLM(GDNConfig.from_preset(args.preset, args.size, **kw)).to(args.device, dtype).eval()
    ids = torch.randint(1, model.config.vocab_size, (args.batch, 8), device=args.device)
    _, gcache = prefill(model, ids)
    cache = StaticCache(model, args.batch, 64)
    cache.load(gcache)
    tokens = ids[:, -1].contiguous()
    kinds = "".join(dict.fromkeys(block_kinds(model)))
    L = model.config.num_hidden_layers
    if args.device.startswith("cuda"):
        counts = cuda_counts(model, cache, tokens, args.profile)
        unit = "kernels (CUDA graph nodes)"
    else:
        counts, detail = cpu_counts(model, cache, tokens, args.triton)
        unit = "aten ops (non-view) and Triton launches, CPU proxy" if args.triton else "aten ops (non-view), CPU proxy"
    print(f"{args.preset} {args.size}, {L} layers ({model.config.layer_pattern}), batch {args.batch}, "
          f"{args.dtype}: {unit}")
    for kind in list(kinds) + ["embed+norm+head", "step", "step (profiler)"]:
        if kind in counts:
            print(f"  {kind:>16}: {counts[kind]}")
    if not args.device.startswith("cuda") and args.detail:
        for kind, c in detail.items():
            print(f"  {kind}: " + ", ".join(f"{n} x{k}" for n, k in sorted(c.items())))


if __name__ == "__main__":
    main()
