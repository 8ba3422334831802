"""Context parallelism on CUDA: the Triton kernels under :mod:`gdn.distributed` equal the
one-process run (tier 2 of docs/DESIGN.md §6, on the GPU).

One GPU stands in for several: 2 and 4 processes all on ``cuda:0``, joined by gloo (NCCL refuses
two ranks on one device). Gloo moves CUDA tensors only in broadcast and all-reduce, so
:mod:`gdn.distributed.comm` stages its all-gathers, reduce-scatters and point-to-point transfers
through host memory; every other line is the code a multi-GPU run executes.

Per rank, for every recurrent member and KDA (the public ops route to Triton on CUDA), fp32 and
bf16, batch rows and packed sequences crossing rank boundaries: the output, the final state (summed
over the ranks) and the gradients of q, k, v, the gates, β, the gate parameters and the initial
state, against the one-process call on the whole sequence and the float64 computation on the same
rounded inputs (the PyTorch chunk form). Bounds, with e1 the one-process run's error against
float64:

- fp32: the context-parallel result within max(1e-5, 2·e1) of the one-process run: the CPU tests'
  tier-2 bound, unless the kernels' own fp32 error (3-pass tf32 dots; SDPA's) is larger.
- bf16: the context-parallel result within max(2·e1, 4e-3) of float64, as :mod:`tests.gpu.helpers`
  bounds half precision; the floor is one bf16 rounding (2^-8), which the split costs by design
  where the one-process run keeps fp32: the outputs o(0) and the transfer rows R_t of the
  continued stretch are in the op's dtype. A wrong state, halo or block is off by O(1).

Global attention (ring and all-gather) the same way, and a hybrid preset (qwen3next tiny: Gated
DeltaNet and global attention) in fp32, forward and backward, against the float64 model on the CPU.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gdn import ops
from gdn.distributed import ContextParallel, recurrent
from gdn.distributed import attention as cp_attention
from tests.distributed.helpers import spawn
from tests.ops.helpers import rel_err

MEMBERS = ("linear_attention", "gated_linear_attention", "delta_rule", "gated_delta_rule", "gated_delta_rule_fused",
           "kimi_delta_attention")
GATES = {"linear_attention": (), "gated_linear_attention": ("g",), "delta_rule": ("beta",),
         "gated_delta_rule": ("g", "beta"), "gated_delta_rule_fused": ("a", "b"), "kimi_delta_attention": ("g", "beta")}
T_TOTAL = 300  # 150 / 75 tokens per rank: slices end inside a 64-token chunk
LAYOUTS = [("rows", None, 2), ("packed", [0, 40, 40, 190, 201, 300], 1)]
H, HV, K, V = 2, 4, 64, 64


def _err(x, ref):
    return rel_err(x.detach().cpu(), ref.detach().cpu())


def _summed(x):
    """The sum over the group of a per-rank tensor (on the CPU, fp64)."""
    x = x.detach().double().cpu().contiguous()
    dist.all_reduce(x)
    return x


def _within(dtype, got, one, ref):
    """(error, bound, e1) of the context-parallel value ``got`` (module docstring)."""
    e1 = _err(one, ref)
    if dtype == torch.float32:
        return _err(got, one), max(1e-5, 2 * e1), e1
    return _err(got, ref), max(2 * e1, 4e-3), e1


def _inputs(member, B, N, dtype, seed, device):
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device=device)

    d = {"q": r(B, T_TOTAL, H, K), "v": r(B, T_TOTAL, HV, V)}
    k = r(B, T_TOTAL, H, K)
    d["k"] = k if member == "gated_delta_rule_fused" else torch.nn.functional.normalize(k, dim=-1)
    gshape = (B, T_TOTAL, HV, K) if member == "kimi_delta_attention" else (B, T_TOTAL, HV)
    d["g"] = -torch.rand(*gshape, generator=gen, device=device) * 0.3
    d["beta"] = torch.rand(B, T_TOTAL, HV, generator=gen, device=device)
    d["a"], d["b"] = r(B, T_TOTAL, HV), r(B, T_TOTAL, HV)
    tok = {n: d[n].to(dtype) for n in ("q", "k", "v") + GATES[member]}
    params = {"A_log": r(HV) * 0.3, "dt_bias": r(HV) * 0.3} if member == "gated_delta_rule_fused" else {}
    return tok, params, r(N, HV, K, V) * 0.5, r(B, T_TOTAL, HV, V).double(), r(N, HV, K, V).double()


def _run(fn_ops, member, tok, params, state, cu=None, cp=None, backend=None):
    """(outputs and gradients) of one call: o, S and the gradient of every leaf."""
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in {**tok, **params, "h0": state}.items()}
    args = [leaves[n] for n in ("q", "k", "v") + GATES[member]] + [leaves[n] for n in params]
    kw = dict(initial_state=leaves["h0"], output_final_state=True, backend=backend)
    kw.update(cu_seqlens=cu) if cp is None else kw.update(cp=cp)
    o, S = getattr(fn_ops, member)(*args, **kw)
    return o, S, leaves


def _check_recurrent(rank, world, device):
    failures = []
    for lname, cu, B in LAYOUTS:
        N = B if cu is None else len(cu) - 1
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
        cp = ContextParallel.split(dist.group.WORLD, T_TOTAL, cu)
        for member in MEMBERS:
            for dtype in (torch.float32, torch.bfloat16):
                tok, params, h0, do, dS = _inputs(member, B, N, dtype, len(member) + 7 * len(lname), device)
                results = {}
                for name, fn_ops, kw in (("ref", ops, dict(cu=cu_t, backend="chunk")), ("single", ops, dict(cu=cu_t)),
                                         ("cp", recurrent, dict(cp=cp))):
                    if name == "ref":  # float64 on the rounded inputs
                        o, S, leaves = _run(fn_ops, member, {n: x.double() for n, x in tok.items()},
                                            {n: x.double() for n, x in params.items()}, h0.double(), **kw)
                        dO, dSS = do, dS
                    elif name == "single":
                        o, S, leaves = _run(fn_ops, member, tok, params, h0, **kw)
                        dO, dSS = do, dS
                    else:
                        o, S, leaves = _run(fn_ops, member, {n: cp.shard(x) for n, x in tok.items()}, params, h0, **kw)
                        dO, dSS = cp.shard(do), dS
                    ((o.double() * dO).sum() + (S.double() * dSS).sum()).backward()
                    results[name] = (o, S, leaves)
                o_ref, S_ref, l_ref = results["ref"]
                o_one, S_one, l_one = results["single"]
                o_cp, S_cp, l_cp = results["cp"]
                # (what, cp value, one-process value, float64 value), compared on this rank's tokens
                rows = [("o", o_cp, cp.shard(o_one), cp.shard(o_ref)), ("S", _summed(S_cp), S_one, S_ref)]
                for n in tok:
                    rows.append((f"d{n}", l_cp[n].grad, cp.shard(l_one[n].grad), cp.shard(l_ref[n].grad)))
                for n in list(params) + ["h0"]:
                    g = l_cp[n].grad if l_cp[n].grad is not None else torch.zeros_like(l_cp[n])
                    rows.append((f"d{n}", _summed(g), l_one[n].grad, l_ref[n].grad))
                for what, got, one, ref in rows:
                    e, bound, e1 = _within(dtype, got, one, ref)
                    if not e <= bound:
                        failures.append(f"{member} {lname} {dtype} rank {rank}/{world}: {what} error {e:.2e} > "
                                        f"{bound:.2e} (one process vs float64 {e1:.2e})")
    return failures


def _check_attention(rank, world, device):
    failures = []
    HQ, HKV, D = 4, 2, 64
    for lname, cu, B in LAYOUTS:
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
        gen = torch.Generator(device=device).manual_seed(3)
        q, k, v, do = (torch.randn(B, T_TOTAL, h, D, generator=gen, device=device) for h in (HQ, HKV, HKV, HQ))
        for dtype in (torch.float32, torch.bfloat16):
            runs = {}
            for name, x64 in (("ref", True), ("single", False)):
                leaves = [(x.double() if x64 else x.to(dtype)).detach().clone().requires_grad_(True) for x in (q, k, v)]
                o = ops.softmax_attention(*leaves, causal=True, cu_seqlens=cu_t)
                (o.double() * do.double()).sum().backward()
                runs[name] = [o] + [x.grad for x in leaves]
            for mode in ("ring", "gather"):
                cp = ContextParallel.split(dist.group.WORLD, T_TOTAL, cu, attention=mode)
                leaves = [cp.shard(x.to(dtype)).detach().clone().requires_grad_(True) for x in (q, k, v)]
                o = cp_attention.softmax_attention(*leaves, cp=cp)
                (o.double() * cp.shard(do).double()).sum().backward()
                got = [o] + [x.grad for x in leaves]
                for what, g, one, ref in zip(("o", "dq", "dk", "dv"), got, runs["single"], runs["ref"]):
                    e, bound, e1 = _within(dtype, g, cp.shard(one), cp.shard(ref))
                    if not e <= bound:
                        failures.append(f"attention {mode} {lname} {dtype} rank {rank}/{world}: {what} error {e:.2e} > "
                                        f"{bound:.2e} (one process vs float64 {e1:.2e})")
    return failures


def _check_model(rank, world, device):
    """qwen3next tiny (three Gated DeltaNet layers, one global attention) in fp32 on a packed row:
    the loss and every parameter's gradient within max(1e-5, 2·e1) of the float64 model on the CPU,
    e1 the one-process GPU model's error."""
    from gdn.models import GDNConfig, GDNForCausalLM

    def model(dtype, device):
        torch.manual_seed(0)
        return GDNForCausalLM(GDNConfig.from_preset("qwen3next", "tiny")).to(dtype).to(device).train()

    def loss_and_grads(m, out):
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    failures = []
    cu = LAYOUTS[1][1]
    ids = torch.randint(0, 256, (1, T_TOTAL), generator=torch.Generator().manual_seed(0))
    m = model(torch.float64, "cpu")
    ref = loss_and_grads(m, m(input_ids=ids, labels=ids, cu_seqlens=torch.tensor(cu)))
    m = model(torch.float32, device)
    one = loss_and_grads(m, m(input_ids=ids.to(device), labels=ids.to(device), cu_seqlens=torch.tensor(cu, device=device)))
    for mode in ("ring", "gather"):
        cp = ContextParallel.split(dist.group.WORLD, T_TOTAL, cu, attention=mode)
        m = model(torch.float32, device)
        loss, grads = loss_and_grads(m, m(input_ids=cp.shard(ids.to(device)), labels=ids.to(device), context_parallel=cp))
        rows = [("loss", _summed(loss), one[0], ref[0])]
        rows += [(f"d{n}", _summed(g), one[1][n], ref[1][n]) for n, g in grads.items()]
        for what, got, o1, r in rows:
            e, e1 = _err(got, r), _err(o1, r)
            if not e <= max(1e-5, 2 * e1):
                failures.append(f"qwen3next {mode} rank {rank}/{world}: {what} error {e:.2e} against float64 "
                                f"(one process {e1:.2e})")
    return failures


def _worker(rank, world, checks, device="cuda"):
    """Every check on every rank; all ranks fail together with every rank's failures. ``device``:
    "cpu" dry-runs the logic (the chunk form instead of Triton)."""
    if device == "cuda":
        torch.cuda.set_device(0)
    mine = [f for check in checks for f in globals()[check](rank, world, device)]
    failures = [None] * world
    dist.all_gather_object(failures, mine)
    failures = [f for per_rank in failures for f in per_rank]
    assert not failures, "\n".join(failures)


def test_two_processes_on_one_gpu():
    spawn(_worker, 2, ["_check_recurrent", "_check_attention", "_check_model"])


def test_four_processes_on_one_gpu():
    spawn(_worker, 4, ["_check_recurrent", "_check_attention"])
