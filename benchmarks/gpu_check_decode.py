"""GPU check of the fused recurrent (decode) kernels against the float64 reference recurrence.

Every entry point of :mod:`gdn.ops.triton.fused_recurrent` and :mod:`gdn.ops.triton.recurrent_pool`
on the GPU, fp32 and bf16 inputs, fp32 state, at awkward shapes (DESIGN §5) and at the decode
benchmark shapes. Tolerances of DESIGN §5 tier 3: relative RMS error ``‖x − ref‖ / ‖ref‖`` ≤ 2e-3
for fp32 inputs and for every state (the state is fp32 arithmetic whatever the inputs); bf16
outputs no worse than 2× the bf16 chunk backend (:mod:`gdn.ops.chunk`) on the same inputs. The
reference runs in float64 on the (already rounded) inputs. Outputs are poisoned with NaN first
wherever the API takes a preallocated buffer, so an unwritten element fails.

    python benchmarks/gpu_check_decode.py        # prints a markdown table; exit 1 on any failure

``main()`` (called by benchmarks/gpu_check.py) prints the table and returns True when all pass.
"""
from __future__ import annotations

import sys
import time

import torch

from gdn.ops import chunk as Ch
from gdn.ops import reference as R
from gdn.ops.triton import fused_recurrent as FR
from gdn.ops.triton import recurrent_pool as RP

MEMBERS = {  # member: (has g, has beta)
    "linear_attention": (False, False),
    "gated_linear_attention": (True, False),
    "delta_rule": (False, True),
    "gated_delta_rule": (True, True),
}
SHAPES = [  # (B, T, H, HV, K, V): awkward, then the decode benchmark shapes
    (2, 1, 1, 2, 60, 100),
    (3, 5, 2, 4, 100, 64),
    (1, 63, 1, 2, 128, 16),
    (2, 2, 1, 1, 256, 256),
    (1, 1, 16, 32, 128, 128),
    (32, 1, 16, 32, 128, 128),
    (256, 1, 16, 32, 128, 128),
]
TOL = 2e-3


def rel_err(x, ref) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def inputs(B, T, H, HV, K, V, dtype, N=None, dev="cuda"):
    """Fresh random inputs: unit-norm keys, g ≤ 0, beta in (0, 1), fp32 state [N, HV, K, V]."""
    N = B if N is None else N
    q = torch.randn(B, T, H, K, device=dev).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, device=dev).to(dtype)
    g = (-torch.rand(B, T, HV, device=dev) * 0.5).to(dtype)
    beta = torch.rand(B, T, HV, device=dev).to(dtype)
    h0 = torch.randn(N, HV, K, V, device=dev) * 0.5
    return q, k, v, g, beta, h0


def ref(member, q, k, v, g, beta, h0, **kw):
    has_g, has_b = MEMBERS[member]
    args = [q.double(), k.double(), v.double()] + ([g.double()] if has_g else []) + ([beta.double()] if has_b else [])
    return getattr(R, member)(*args, initial_state=None if h0 is None else h0.double(), output_final_state=True, **kw)


def chunk_err(member, q, k, v, g, beta, h0, o_ref, **kw):
    """The bf16 baseline of DESIGN §5: the chunk backend's output error on the same inputs."""
    has_g, has_b = MEMBERS[member]
    args = [q, k, v] + ([g] if has_g else []) + ([beta] if has_b else [])
    o, _ = getattr(Ch, member)(*args, initial_state=h0, output_final_state=True, **kw)
    return rel_err(o, o_ref)


class Table:
    """Collects check rows: name, dtype, shape, errors, bound, pass."""

    def __init__(self):
        self.rows = []

    def add(self, name, dtype, shape, errs: dict, bounds: dict):
        ok = all(errs[key] <= bounds[key] for key in errs)
        self.rows.append({"check": name, "dtype": str(dtype).replace("torch.", ""), "shape": shape,
                          "errors": ", ".join(f"{key} {errs[key]:.2e} (≤ {bounds[key]:.1e})" for key in errs),
                          "ok": ok})

    def markdown(self) -> str:
        lines = ["| check | dtype | shape | rel. RMS error (bound) | pass |", "|---|---|---|---|---|"]
        lines += [f"| {r['check']} | {r['dtype']} | {r['shape']} | {r['errors']} | {'yes' if r['ok'] else '**NO**'} |"
                  for r in self.rows]
        return "\n".join(lines)


def o_bound(dtype, member, q, k, v, g, beta, h0, o_ref, **kw):
    return TOL if dtype == torch.float32 else 2 * chunk_err(member, q, k, v, g, beta, h0, o_ref, **kw)


def check_plain(t: Table):
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            B, T, H, HV, K, V = shape
            for member, (has_g, has_b) in MEMBERS.items():
                if shape not in SHAPES[:2] and member != "gated_delta_rule":
                    continue  # every member at two awkward shapes; Gated DeltaNet at all
                q, k, v, g, beta, h0 = inputs(*shape, dtype)
                args = [q, k, v] + ([g] if has_g else []) + ([beta] if has_b else [])
                o, S = getattr(FR, "fused_recurrent_" + member)(*args, initial_state=h0, output_final_state=True)
                o_ref, S_ref = ref(member, q, k, v, g, beta, h0)
                bound = o_bound(dtype, member, q, k, v, g, beta, h0, o_ref)
                t.add(f"plain {member}", dtype, "x".join(map(str, shape)),
                      {"o": rel_err(o, o_ref), "S": rel_err(S, S_ref)}, {"o": bound, "S": TOL})


def check_packed_and_l2norm(t: Table):
    lens = [1, 5, 63, 2, 1]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, g, beta, h0 = inputs(1, sum(lens), 2, 4, 100, 60, dtype, N=len(lens))
        o, S = FR.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   cu_seqlens=cu)
        o_ref, S_ref = ref("gated_delta_rule", q, k, v, g, beta, h0, cu_seqlens=cu)
        bound = o_bound(dtype, "gated_delta_rule", q, k, v, g, beta, h0, o_ref, cu_seqlens=cu)
        t.add("plain packed (cu_seqlens on GPU)", dtype, f"lens {lens}, H2 HV4 K100 V60",
              {"o": rel_err(o, o_ref), "S": rel_err(S, S_ref)}, {"o": bound, "S": TOL})

        q, k, v, g, beta, h0 = inputs(4, 3, 16, 32, 128, 128, dtype)
        k = (k.float() * 3 + 0.1).to(dtype)
        o, S = FR.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   use_qk_l2norm=True)
        qn, kn = (x.double() / torch.sqrt((x.double() ** 2).sum(-1, keepdim=True) + FR.L2NORM_EPS) for x in (q, k))
        o_ref, S_ref = ref("gated_delta_rule", qn, kn, v, g, beta, h0)
        t.add("plain use_qk_l2norm", dtype, "4x3x16x32x128x128",
              {"o": rel_err(o, o_ref), "S": rel_err(S, S_ref)},
              {"o": TOL if dtype == torch.float32 else 1e-2, "S": TOL})


def check_pool(t: Table):
    for dtype in (torch.float32, torch.bfloat16):
        for N, P in ((3, 7), (256, 300)):
            H, HV, K, V = (1, 2, 60, 100) if N == 3 else (16, 32, 128, 128)
            q, k, v, g, beta, _ = inputs(N, 1, H, HV, K, V, dtype)
            pool = torch.randn(P, HV, K, V, device="cuda")
            slots = torch.randperm(P, device="cuda")[:N].to(torch.int32)
            slots[1] = -1
            before = pool.clone()
            out = torch.full((N, 1, HV, V), float("nan"), dtype=dtype, device="cuda")
            o = RP.fused_recurrent_gated_delta_rule_pool(q, k, v, g, beta, state_pool=pool, slot_indices=slots, out=out)
            live = (slots >= 0).nonzero().squeeze(1)
            o_ref, S_ref = ref("gated_delta_rule", q[live], k[live], v[live], g[live], beta[live],
                               before[slots[live].long()])
            touched = torch.zeros(P, dtype=torch.bool, device="cuda")
            touched[slots[live].long()] = True
            untouched_ok = torch.equal(pool[~touched], before[~touched]) and not torch.any(o[1] != 0)
            bound = o_bound(dtype, "gated_delta_rule", q[live], k[live], v[live], g[live], beta[live],
                            before[slots[live].long()], o_ref)
            t.add("pool in place (+ padding, untouched slots)", dtype, f"N{N} P{P} H{H} HV{HV} K{K} V{V}",
                  {"o": rel_err(o[live], o_ref), "S": rel_err(pool[slots[live].long()], S_ref),
                   "untouched": 0.0 if untouched_ok else float("inf")}, {"o": bound, "S": TOL, "untouched": 0.0})


def check_spec(t: Table):
    for dtype in (torch.float32, torch.bfloat16):
        N, T, H, HV, K, V, P = 32, 4, 16, 32, 128, 128, 40
        q, k, v, g, beta, _ = inputs(N, T, H, HV, K, V, dtype)
        pool = torch.randn(P, HV, K, V, device="cuda")
        slots = torch.randperm(P, device="cuda")[:N].to(torch.int32)
        before = pool.clone()
        o, states = RP.fused_recurrent_gated_delta_rule_spec(q, k, v, g, beta, state_pool=pool, slot_indices=slots)
        h0 = before[slots.long()]
        errs = {"pool untouched": 0.0 if torch.equal(pool, before) else float("inf")}
        for i in range(T):
            _, S_i = ref("gated_delta_rule", q[:, : i + 1], k[:, : i + 1], v[:, : i + 1], g[:, : i + 1],
                         beta[:, : i + 1], h0)
            errs[f"S{i}"] = rel_err(states[:, i], S_i)
        accepted = torch.randint(0, T + 1, (N,), device="cuda", dtype=torch.int32)
        RP.commit_spec_states(pool, slots, states, accepted)
        want = before.clone()
        keep = accepted > 0
        want[slots[keep].long()] = states[keep.nonzero().squeeze(1), accepted[keep].long() - 1]
        errs["commit"] = 0.0 if torch.equal(pool, want) else float("inf")
        o_ref, _ = ref("gated_delta_rule", q, k, v, g, beta, h0)
        errs["o"] = rel_err(o, o_ref)
        bounds = {key: (0.0 if key in ("pool untouched", "commit") else TOL) for key in errs}
        bounds["o"] = o_bound(dtype, "gated_delta_rule", q, k, v, g, beta, h0, o_ref)
        t.add("spec states per token + commit", dtype, f"N{N} T{T} H{H} HV{HV} K{K} V{V}", errs, bounds)


def check_graph(t: Table):
    for dtype in (torch.float32, torch.bfloat16):
        N, H, HV, K, V, P = 8, 16, 32, 128, 128, 16
        pool = torch.randn(P, HV, K, V, device="cuda")
        before = pool.clone()
        graph = RP.DecodeGraph(pool, N, H, dtype=dtype)
        errs = {"capture left pool": 0.0 if torch.equal(pool, before) else float("inf")}
        slots = torch.randperm(P, device="cuda")[:N].to(torch.int32)
        S = before[slots.long()].double()
        for step in range(3):
            q, k, v, g, beta, _ = inputs(N, 1, H, HV, K, V, dtype)
            o = graph(q, k, v, g, beta, slot_indices=slots).clone()
            o_ref, S = ref("gated_delta_rule", q, k, v, g, beta, S)
            errs[f"o{step}"] = rel_err(o, o_ref)
        errs["S"] = rel_err(pool[slots.long()], S)
        bounds = {key: TOL if dtype == torch.float32 or key == "S" else 1e-2 for key in errs}
        bounds["capture left pool"] = 0.0
        t.add("DecodeGraph: 3 replays", dtype, f"N{N} H{H} HV{HV} K{K} V{V}", errs, bounds)


def main() -> bool:
    """Run every decode check on the GPU, print the markdown table; True when all pass."""
    torch.manual_seed(0)
    t = Table()
    with torch.inference_mode():
        for fn in (check_plain, check_packed_and_l2norm, check_pool, check_spec):
            start = time.perf_counter()
            fn(t)
            print(f"{fn.__name__}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    check_graph(t)  # graph capture outside inference mode (DecodeGraph enters it itself)
    print(t.markdown())
    failed = [r for r in t.rows if not r["ok"]]
    print(f"\ndecode checks: {len(t.rows) - len(failed)}/{len(t.rows)} passed")
    return not failed


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
