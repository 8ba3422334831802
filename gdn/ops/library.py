"""The ops as ``torch.library`` custom ops: what ``torch.compile`` sees of them.

The rule. In eager mode every public op runs its implementation directly, as it always did: no
dispatcher, no extra host time. While ``torch.compile`` traces (:func:`compiling`), each public op
validates and routes its call as in eager mode (:mod:`.checks`, :mod:`.router`: traced, so the
decision is made once at trace time) and then calls its custom op in the ``gdn`` namespace. Dynamo
and AOT autograd see that op as one opaque node: a fake implementation gives its outputs' shapes
and dtypes, ``register_autograd`` its backward, and at run time it runs the implementation that
the router picked, passed as a string (PyTorch on the CPU, the Triton kernels on CUDA: the same
registration on both). Which ops are registered and why:

- the recurrences (the four scalar-gate members, :func:`gdn.ops.kimi_delta_attention` and
  :func:`gdn.ops.gated_delta_rule_fused`): on CUDA their Triton launchers cannot be traced, and on
  the CPU the chunk form would unroll into thousands of graph nodes. Their backward is a second
  custom op that **recomputes the forward** under autograd on detached inputs and differentiates it
  (:func:`recomputed_op`): a compiled training step costs one more forward of each recurrence than
  an eager one, which keeps the intermediates of its forward for its backward.
- the glue ops (:mod:`.norm`, :mod:`.conv`, :mod:`.swiglu`, :mod:`.loss`): on CUDA they are
  Triton kernels inside autograd Functions, which dynamo cannot trace; on the CPU the short
  convolution's backward differentiates a recomputation (``torch.autograd.grad``, a graph break).
  They are registered on both devices, so the CPU tests cover the structure the GPU runs. RMSNorm,
  SwiGLU and the loss keep their eager backward (forward and backward ops share the autograd
  Function's own code: nothing is recomputed); the short convolution recomputes its forward, on
  the CPU as its eager backward does.
- softmax attention: dynamo traces ``F.scaled_dot_product_attention`` and the sliding window's
  query blocks, so only a packed call is registered (``gdn::softmax_attention``, recomputing
  backward): it loops over the sequences, whose bounds it reads on the host.

Packed calls (``cu_seqlens`` given) read the offsets' values on the host at run time (the chunk
layout, attention's per-sequence loop), which a CUDA graph cannot capture and a replay would not
redo: the recurrences' packed calls go through ops of their own (``gdn::gated_delta_rule_packed``
etc., :data:`PACKED_RECURRENT_OPS`; each registered beside its dense op by :func:`op_pair`), and
they and the packed attention op are tagged ``torch.Tag.cudagraph_unsafe`` (:data:`HOST_READS`).
Under ``torch.compile(mode="reduce-overhead")`` Inductor then runs them outside its CUDA graphs
(between the graphed partitions of the step), while the dense calls, whose layouts depend on
shapes alone, stay inside.

Custom ops take tensors (optional ones as ``Tensor?``) and plain scalars; an output that the call
does not produce (a final state not asked for, a gradient nobody needs) comes back as an empty
tensor and is turned back into None by the caller. The autocast state of the call is an argument
of the ops whose PyTorch form it changes, so the forward, its recomputation in the backward and
the eager call all see the same one.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from . import delta, kda
from .delta.reference import compute_dtype
from .router import TRITON_CHUNK, TRITON_RECURRENT

__all__ = ["NAMESPACE", "HOST_READS", "compiling", "autocast_of", "autocast_as", "autograd_inside",
           "recomputed_op", "op_pair", "none_if_empty", "state_dtype", "recurrent_fake", "RECURRENT_OPS",
           "PACKED_RECURRENT_OPS", "recurrent"]

NAMESPACE = "gdn"

#: True while dynamo traces (torch.compile, torch.export): the public ops then call their custom op.
compiling = torch.compiler.is_compiling

#: The tags of an op that reads tensor values on the host at run time (packed offsets): Inductor
#: keeps it out of CUDA graphs.
HOST_READS = (torch.Tag.cudagraph_unsafe,)

_AUTOGRAD_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor))


def autocast_of(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype active for ``x``'s device, or None when autocast is off there."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def autocast_as(device_type: str, dtype: torch.dtype | None):
    """A context with autocast on in ``dtype`` for ``device_type``, or off when ``dtype`` is None."""
    if dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype)


@contextlib.contextmanager
def autograd_inside():
    """Autograd recording inside a custom op's implementation.

    The dispatcher runs an implementation below the autograd dispatch keys (it excludes them
    while the op's own autograd formula, or none, is in charge), so the operations there record
    no graph even under ``torch.enable_grad()``. A backward that differentiates a recomputation
    needs them back: this lifts that exclusion (and only it) and turns grad mode on."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude - _AUTOGRAD_KEYS), torch.enable_grad():
        yield


def none_if_empty(x: torch.Tensor | None, wanted: bool = True) -> torch.Tensor | None:
    """An op's optional output as the public API gives it: None where the call produced none."""
    return x if wanted and x is not None and x.numel() else None


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


def recomputed_op(name: str, params: str, n_out: int, fn: Callable, fake: Callable,
                  differentiable: Sequence[int], tags: Sequence[torch.Tag] = ()):
    """Register ``gdn::<name>`` (``fn``) with a backward that recomputes it: ``gdn::<name>_backward``.

    Args:
        name: the op's name in the ``gdn`` namespace.
        params: its parameters in schema syntax, e.g. ``"Tensor x, Tensor? h, float eps"``.
        n_out: number of tensor outputs (the schema returns a tuple of them).
        fn: ``fn(*args) -> tuple of n_out tensors`` (the op returns the tensor itself when
            ``n_out == 1``), run without autograd as the forward and with it, on detached copies
            of the inputs, in the backward. It must not return an input or a view of one, nor two
            views of one tensor, and its outputs must be contiguous (the fakes are).
        fake: ``fake(*args)``: tensors of the outputs' shapes, dtypes and devices.
        differentiable: positions of the float tensor parameters that can get a gradient.
        tags: the ``torch.Tag`` values of both ops (:data:`HOST_READS` for one that reads tensor
            values on the host).

    The backward op gets the output gradients, the forward's arguments and which inputs need a
    gradient; it returns one tensor per ``differentiable`` parameter, the gradient or an empty
    tensor where none is needed (a needed gradient the output does not depend on is zeros).
    Returns the forward op.
    """
    qualified = f"{NAMESPACE}::{name}"
    if n_out == 1:  # the schema returns a Tensor, not a tuple of one
        outs, forward, forward_fake = "Tensor", lambda *a: fn(*a)[0], lambda *a: fake(*a)[0]
    else:
        outs, forward, forward_fake = "(" + ", ".join(["Tensor"] * n_out) + ")", fn, fake
    op = torch.library.custom_op(qualified, forward, mutates_args=(), schema=f"({params}) -> {outs}",
                                 tags=tuple(tags))
    op.register_fake(forward_fake)
    diff = tuple(differentiable)

    def backward_impl(grads, needs, *args):
        ins = list(args)
        leaves = []
        for j, i in enumerate(diff):
            if needs[j] and ins[i] is not None:
                ins[i] = ins[i].detach().requires_grad_(True)
                leaves.append((j, ins[i]))
        result = [_empty(args[i] if args[i] is not None else args[diff[0]]) for i in diff]
        if not leaves:
            return result
        with autograd_inside():
            recomputed = fn(*ins)
            pairs = [(o, g) for o, g in zip(recomputed, grads) if g is not None and o.requires_grad and o.numel()]
            got = [None] * len(leaves)
            if pairs:
                got = torch.autograd.grad([o for o, _ in pairs], [x for _, x in leaves], [g for _, g in pairs],
                                          allow_unused=True)
        for (j, leaf), g in zip(leaves, got):
            result[j] = torch.zeros_like(leaf, memory_format=torch.contiguous_format) if g is None else g.contiguous()
        return result

    def backward_fake(grads, needs, *args):
        return [args[i].new_empty(args[i].shape) if needs[j] and args[i] is not None
                else args[diff[0]].new_empty(0) for j, i in enumerate(diff)]

    bwd = torch.library.custom_op(f"{qualified}_backward", backward_impl, mutates_args=(),
                                  schema=f"(Tensor?[] grads, bool[] needs, {params}) -> Tensor[]", tags=tuple(tags))
    bwd.register_fake(backward_fake)

    def setup_context(ctx, inputs, output):
        tensors = [x if isinstance(x, torch.Tensor) else None for x in inputs]
        ctx.save_for_backward(*tensors)
        ctx.constants = [None if isinstance(x, torch.Tensor) else x for x in inputs]

    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        args = [t if t is not None else c for t, c in zip(saved, ctx.constants)]
        needs = [bool(ctx.needs_input_grad[i]) for i in diff]
        got = bwd(list(grads), needs, *args)
        out = [None] * len(args)
        for j, i in enumerate(diff):
            out[i] = got[j] if needs[j] else None
        return tuple(out)

    op.register_autograd(backward, setup_context=setup_context)
    return op


# ---- the recurrences ----------------------------------------------------------------------------

_RECURRENT_PARAMS = ("str impl, Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, float? scale, "
                     "Tensor? initial_state, bool output_final_state, Tensor? cu_seqlens, ScalarType? autocast")


def state_dtype(impl: str, v: torch.Tensor) -> torch.dtype:
    """dtype of the final state an implementation returns: fp32 from the kernels, the compute
    dtype (fp32, fp64 for fp64 inputs) from the PyTorch forms."""
    return torch.float32 if impl in (TRITON_CHUNK, TRITON_RECURRENT) else compute_dtype(v)


def recurrent_fake(impl, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, autocast):
    """Outputs of a recurrence: o [B, T, HV, V] in v.dtype; the state [N, HV, K, V] or empty."""
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = v.new_empty(v.shape)
    shape = (N, v.shape[2], q.shape[3], v.shape[3]) if output_final_state else (0,)
    return o, v.new_empty(shape, dtype=state_dtype(impl, v))


def _member(family):
    def run(impl, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, autocast):
        with autocast_as(q.device.type, autocast):
            o, S = family.run(impl, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens)
        return o.contiguous(), (S.contiguous() if S is not None else v.new_empty(0, dtype=state_dtype(impl, v)))

    return run


def op_pair(name: str, params: str, n_out: int, fn: Callable, fake: Callable, differentiable: Sequence[int]):
    """(``gdn::<name>``, ``gdn::<name>_packed``): :func:`recomputed_op` of ``fn`` for calls without
    ``cu_seqlens`` and for packed calls, the packed one tagged :data:`HOST_READS`."""
    return tuple(recomputed_op(name + suffix, params, n_out, fn, fake, differentiable, tags)
                 for suffix, tags in (("", ()), ("_packed", HOST_READS)))


_PAIRS = {
    name: op_pair(name, _RECURRENT_PARAMS, 2, _member(kda if name == "kimi_delta_attention" else delta),
                  recurrent_fake, differentiable=(1, 2, 3, 4, 5, 7))
    for name in ("linear_attention", "gated_linear_attention", "delta_rule", "gated_delta_rule",
                 "kimi_delta_attention")
}
#: The recurrences' custom ops for calls without ``cu_seqlens``, by public name: ``gdn::gated_delta_rule`` etc.
RECURRENT_OPS = {name: pair[0] for name, pair in _PAIRS.items()}
#: Their ops for packed calls, tagged :data:`HOST_READS`: ``gdn::gated_delta_rule_packed`` etc.
PACKED_RECURRENT_OPS = {name: pair[1] for name, pair in _PAIRS.items()}


def recurrent(op: str, impl: str, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """A validated, routed call of recurrence ``op`` through its custom op: ``(o, state or None)``."""
    fn = (RECURRENT_OPS if cu_seqlens is None else PACKED_RECURRENT_OPS)[op]
    o, S = fn(impl, q, k, v, g, beta, None if scale is None else float(scale), initial_state,
              bool(output_final_state), cu_seqlens, autocast_of(q))
    return o, none_if_empty(S, output_final_state)
