"""Activation memory of one training forward: the bytes autograd keeps for the backward, per
module role and per layer, measured on the CPU with ``torch.autograd.graph.saved_tensors_hooks``.

Every tensor saved for backward during one forward is attributed to the innermost module running
when it was saved (its role: the module path with ``model.layers.<i>.`` cut off) and counted once
per storage (a storage saved by two modules counts for the first). Parameters are not counted
(they are alive anyway); the autocast bf16 copies of the weights are a separate row (their size
does not grow with the tokens). The ``floor`` column is the least each role must keep under the
same design (see docs/BENCHMARKS.md, "Activation memory").

The token mixer's core (L2 norm, gate, gated delta rule) runs on the GPU as Triton autograd
Functions whose saves are fixed by gdn/ops; on the CPU it runs the PyTorch chunk form, which
saves far more. By default (``--core triton``) the core is replaced here by a stand-in that
computes the same output and saves exactly the tensors the Triton path saves (the L2 norms'
inputs and rstd, the gate's inputs and g, the chunk op's q̂, k̂, v, g, β and its
[B·T, HV, 64] in-chunk inverse), so the table reads as the H200 step would; ``--core chunk``
measures the CPU op instead.

    python benchmarks/memory.py --size 340m --seq-len 512 --batch 1 --dtype bf16 --project 4x4096
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
from collections import defaultdict

import torch

from gdn import ops
from gdn.ops.delta.fused import gated_delta_rule_fused
from gdn.models import GDNConfig, GDNForCausalLM

try:
    from gdn.ops.triton.rows import rows
except ImportError:  # no Triton: every kernel input counts as the contiguous copy it would be
    rows = None


def _as_saved(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the prologue kernels save it: in place when they read its layout, else a contiguous copy."""
    return rows(x).t if rows is not None else x.contiguous()

MiB = 2**20
GiB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gdn", help="gdn preset")
    p.add_argument("--size", default="340m", help="tiny, 125m, 340m, 1.3b")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="bf16 autocast or plain fp32")
    p.add_argument("--core", choices=("triton", "chunk"), default="triton",
                   help="triton: stand-in saving what the GPU core saves; chunk: the CPU op as it runs")
    p.add_argument("--project", default="4x4096", help="BxT to project the per-token bytes to")
    p.add_argument("--layers", type=int, default=0, help="override the number of layers (0 = the preset's)")
    return p.parse_args(argv)


class _TritonCoreStandIn(torch.autograd.Function):
    """Output of :func:`gdn.ops.gated_delta_rule_fused`; saves what its Triton path saves
    (gdn/ops/delta/triton/prologue.py and chunk.py). Forward only: this script never runs a
    backward, it counts what one would need."""

    @staticmethod
    def forward(ctx, q, k, v, a, b, A_log, dt_bias, kw):
        with torch.no_grad():
            o, S = gated_delta_rule_fused(q, k, v, a, b, A_log, dt_bias, **kw)
        B, T, H, K = q.shape
        HV = v.shape[2]
        qc, kc = _as_saved(q), _as_saved(k)  # the prologue saves q and k as it read them, and their rstd
        rq = q.new_empty(B * T * H, dtype=torch.float32)
        rk = k.new_empty(B * T * H, dtype=torch.float32)
        g = torch.empty(a.shape, dtype=torch.float32)  # and a, b, A_log, dt_bias and g
        beta = torch.empty(a.shape, dtype=torch.float32)
        qh, kh = q.new_empty(q.shape), k.new_empty(k.shape)  # chunk op: q̂, k̂, v, g, β, Ai
        vp = v.reshape(B * T, HV, v.shape[3])
        Ai = torch.empty(B * T, HV, 64, dtype=v.dtype)
        ctx.save_for_backward(qc, kc, vp, _as_saved(a), _as_saved(b), A_log, dt_bias, rq, rk, g, beta, qh, kh, Ai)
        ctx.kw = kw
        return o, S


def _is_weight_cast(t: torch.Tensor) -> bool:
    """Whether ``t`` is (a view of) autocast's low-precision copy of a parameter: its graph is a
    chain of views down to a dtype cast of a leaf."""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None or len(fn.next_functions) != 1:
            return False
        nxt = fn.next_functions[0][0]
        if type(fn).__name__ == "ToCopyBackward0":
            return type(nxt).__name__ == "AccumulateGrad"
        fn = nxt
    return False


class SavedTensorLedger:
    """Bytes saved for backward, by role and layer, each storage counted once."""

    def __init__(self, model: torch.nn.Module):
        self.stack: list[str] = ["(top)"]
        self.seen: set[int] = set()
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        head = model.get_output_embeddings()
        self.head_shape = tuple(head.weight.shape) if head is not None else None
        self.bytes: dict[tuple[str, int], int] = defaultdict(int)
        self.dtypes: dict[str, set] = defaultdict(set)
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._enter(name or "(top)")))
            self.handles.append(mod.register_forward_hook(self._leave))

    def _enter(self, name):
        def hook(module, args):
            self.stack.append(name)
        return hook

    def _leave(self, module, args, out):
        self.stack.pop()

    @contextlib.contextmanager
    def scope(self, suffix: str):
        """Attribute what is saved inside to ``<current module>.<suffix>``."""
        self.stack.append(f"{self.stack[-1]}.{suffix}")
        try:
            yield
        finally:
            self.stack.pop()

    @staticmethod
    def role_of(name: str) -> tuple[str, int]:
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] == "model" and parts[1] == "layers":
            return ".".join(parts[3:]) or "(block)", int(parts[2])
        return name, -1

    def pack(self, t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self.params and ptr not in self.seen and st.nbytes():
                self.seen.add(ptr)
                if _is_weight_cast(t):
                    role, layer = "(autocast weight copies)", -1
                elif self.stack[-1] == "(top)" and tuple(t.shape) == self.head_shape:
                    role, layer = "(the head's weight gradient)", -1
                else:
                    role, layer = self.role_of(self.stack[-1])
                self.bytes[(role, layer)] += st.nbytes()
                self.dtypes[role].add(str(t.dtype).replace("torch.", ""))
        return t

    def close(self):
        for h in self.handles:
            h.remove()


def floors(cfg: GDNConfig, act: int, resid: int) -> dict[str, int]:
    """Least bytes per token each role of a Gated DeltaNet block keeps (act: bytes of the
    autocast dtype, resid: of the residual stream), under this design (see the module docstring)."""
    D, Dk = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    HV = cfg.num_v_heads
    Dv = HV * int(cfg.head_dim * cfg.expand_v)
    I = cfg.intermediate_size  # noqa: E741
    core = 2 * Dk * act + 2 * cfg.num_heads * 4 + 2 * Dk * act + Dv * act + 2 * HV * act + 2 * HV * 4 + HV * 64 * act
    return {
        "mixer_norm": D * resid + 4,            # its input and rstd
        "mixer.q_proj": D * act,                # the norm's output, shared by the six projections
        "mixer.k_proj": 0, "mixer.v_proj": 0, "mixer.a_proj": 0, "mixer.b_proj": 0, "mixer.g_proj": 0,
        "mixer.q_conv": Dk * act, "mixer.k_conv": Dk * act, "mixer.v_conv": Dv * act,  # conv inputs
        "mixer.core": core,                     # fixed by gdn/ops (Triton path)
        "mixer.o_norm": 2 * Dv * act + HV * 4,  # o, the gate, rstd per head
        "mixer.o_proj": Dv * act,
        "mlp_norm": D * resid + 4,
        "mlp": 2 * I * act,                     # gate and up (the product is recomputed)
        "mlp.gate_proj": D * act,               # the norm's output, shared by gate and up
        "mlp.up_proj": 0, "mlp.down_proj": 0,
    }


#: roles whose saved bytes do not grow with the tokens (the projection adds them once)
FIXED = ("(autocast weight copies)", "(the head's weight gradient)")


def head_floor(cfg: GDNConfig, act: int, resid: int) -> dict[str, int]:
    """Per token: the final norm (input, rstd); the loss's gradient of the head's input (the loss
    forms its gradients in the forward; the head's weight gradient, fp32, is a role of its own)."""
    return {"model.norm": cfg.hidden_size * resid + 4, "(top)": cfg.hidden_size * act}


def measure(a):
    torch.manual_seed(0)
    cfg = GDNConfig.from_preset(a.preset, a.size, **({"num_hidden_layers": a.layers} if a.layers else {}))
    model = GDNForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len))
    ledger = SavedTensorLedger(model)
    real_core = ops.gated_delta_rule_fused

    def core(q, k, v, a_, b_, A_log, dt_bias, **kw):
        with ledger.scope("core"):
            if a.core == "triton":
                return _TritonCoreStandIn.apply(q, k, v, a_, b_, A_log, dt_bias, kw)
            return real_core(q, k, v, a_, b_, A_log, dt_bias, **kw)

    ops.gated_delta_rule_fused = core
    try:
        with torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
                model(input_ids=ids, labels=ids, use_cache=False)
    finally:
        ops.gated_delta_rule_fused = real_core
        ledger.close()
    return cfg, model, ledger


def report(a, cfg, model, ledger):
    tokens = a.batch * a.seq_len
    n_layers = cfg.num_hidden_layers
    act = 2 if a.dtype == "bf16" else 4
    fl = floors(cfg, act, 4) if set(cfg.layer_pattern) == {"G"} else {}
    hf = head_floor(cfg, act, 4)
    per_role_layers: dict[str, list[int]] = defaultdict(list)
    outside: dict[str, int] = {}
    for (role, layer), nb in ledger.bytes.items():
        if layer >= 0:
            per_role_layers[role].append(nb)
        else:
            outside[role] = outside.get(role, 0) + nb
    Bp, Tp = (int(s) for s in a.project.lower().split("x"))
    proj_tokens = Bp * Tp
    print(f"saved for backward, one forward: preset {a.preset}, size {a.size}, {n_layers} layers, batch {a.batch} x "
          f"{a.seq_len} = {tokens} tokens, {'bf16 autocast' if a.dtype == 'bf16' else 'fp32'}, core as on "
          f"{'the GPU (Triton stand-in)' if a.core == 'triton' else 'the CPU (chunk op)'}; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {datetime.date.today()}")
    print("| role | dtypes | MiB / layer | bytes / token / layer | floor | x floor |")
    print("|---|---|---:|---:|---:|---:|")
    layer_total = 0
    floor_total = 0
    for role, vals in per_role_layers.items():
        mean = sum(vals) / n_layers
        layer_total += mean
        f = fl.get(role)
        floor_total += f or 0
        ratio = f"{mean / tokens / f:.2f}" if f else ("1.00" if f == 0 and mean == 0 else "—")
        print(f"| {role} | {','.join(sorted(ledger.dtypes[role]))} | {mean / MiB:.2f} | {mean / tokens:,.0f} | "
              f"{f if f is not None else '—'} | {ratio} |")
    by_layer: dict[int, int] = defaultdict(int)
    for (role, layer), nb in ledger.bytes.items():
        if layer >= 0:
            by_layer[layer] += nb
    missing = [r for r in fl if r not in per_role_layers]
    for role in missing:
        floor_total += fl[role]
        print(f"| {role} | — | 0.00 | 0 | {fl[role]} | {'1.00' if fl[role] == 0 else '0.00'} |")
    print(f"| **one layer** | | **{layer_total / MiB:.2f}** | **{layer_total / tokens:,.0f}** | "
          f"**{floor_total or '—'}** | {f'{layer_total / tokens / floor_total:.2f}' if floor_total else '—'} |")
    if by_layer:
        print(f"per layer: {min(by_layer.values()) / MiB:.2f} to {max(by_layer.values()) / MiB:.2f} MiB "
              f"over layers {min(by_layer)}..{max(by_layer)}")
    print()
    print("| outside the layers | dtypes | MiB | bytes / token | floor |")
    print("|---|---|---:|---:|---:|")
    out_tok = 0
    fixed = 0
    for role, nb in outside.items():
        if role in FIXED:
            fixed += nb
        else:
            out_tok += nb
        f = hf.get(role, "—") if role not in FIXED else "—"
        print(f"| {role} | {','.join(sorted(ledger.dtypes[role]))} | {nb / MiB:.2f} | {nb / tokens:,.0f} | {f} |")
    total = layer_total * n_layers + sum(outside.values())
    per_token = (layer_total * n_layers + out_tok) / tokens
    print()
    print(f"total saved: {total / MiB:,.1f} MiB ({n_layers} layers x {layer_total / MiB:.2f} MiB + "
          f"{sum(outside.values()) / MiB:.1f} MiB outside); {per_token / 1024:,.1f} KiB per token")
    n_params = sum(p.numel() for p in model.parameters())
    states = 16 * n_params  # fp32 weights, gradients and AdamW's two moments
    proj = per_token * proj_tokens + fixed
    print(f"projected to {Bp} x {Tp} = {proj_tokens} tokens: {proj / GiB:.1f} GiB saved for backward "
          f"+ {states / GiB:.1f} GiB weights, gradients and AdamW states ({n_params / 1e6:.1f}M parameters) "
          f"= {(proj + states) / GiB:.1f} GiB before the backward's transients")


def main(argv=None):
    a = parse_args(argv)
    cfg, model, ledger = measure(a)
    report(a, cfg, model, ledger)


if __name__ == "__main__":
    main()
