"""Shared helpers for the op tests: random inputs and the relative RMS error of DESIGN §5."""
from __future__ import annotations

import torch

MEMBERS = ("linear_attention", "gated_linear_attention", "delta_rule", "gated_delta_rule")
HAS_G = {"linear_attention": False, "gated_linear_attention": True, "delta_rule": False, "gated_delta_rule": True}
HAS_BETA = {"linear_attention": False, "gated_linear_attention": False, "delta_rule": True, "gated_delta_rule": True}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64; NaN or Inf anywhere never passes (returns inf)."""
    x, ref = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x).all():
        return float("inf")
    den = ref.norm()
    return float((x - ref).norm() / den) if den > 0 else float((x - ref).norm())


def make_inputs(B=1, T=16, H=2, HV=None, K=8, V=8, *, dtype=torch.float64, N=None, state=True, seed=None,
                g_scale=0.5, requires_grad=False):
    """Random q, k (L2-normalised), v, g (≤ 0), beta (in (0, 1)) and an initial state.

    Returns a dict of the op arguments. ``N`` sets the number of states (packed sequences)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
    HV = HV or H
    N = B if N is None else N

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    d = {
        "q": r(B, T, H, K),
        "k": torch.nn.functional.normalize(r(B, T, H, K), dim=-1),
        "v": r(B, T, HV, V),
        "g": -torch.rand(B, T, HV, generator=gen, dtype=torch.float64) * g_scale,
        "beta": torch.rand(B, T, HV, generator=gen, dtype=torch.float64),
        "initial_state": r(N, HV, K, V) * 0.5 if state else None,
    }
    out = {}
    for name, x in d.items():
        if x is None:
            out[name] = None
            continue
        x = x.to(torch.float32 if name == "initial_state" and dtype in (torch.float16, torch.bfloat16) else dtype)
        out[name] = x.requires_grad_(requires_grad)
    return out


def call(module, member: str, d: dict, **kw):
    """Call ``module.member`` with the positional arguments that member takes."""
    args = [d["q"], d["k"], d["v"]]
    if HAS_G[member]:
        args.append(d["g"])
    if HAS_BETA[member]:
        args.append(d["beta"])
    return getattr(module, member)(*args, initial_state=d.get("initial_state"), **kw)


def spy_group_sum(monkeypatch, module) -> list:
    """Record (dtype, group size) of each ``module.group_sum`` call (the partials a grouped-head
    backward sums), calling through to the real one."""
    seen = []
    real = module.group_sum

    def spy(x, width, dtype):
        seen.append((x.dtype, x.shape[-2]))
        return real(x, width, dtype)

    monkeypatch.setattr(module, "group_sum", spy)
    return seen


def warm_walks(k, beta, g, cu, seg_cu, seq, HV, after, delta=True, eps=-16.0, BT=64):
    """The warm-up walk of every segment and value head written out in float64 (the reference of
    split.warm_plan): {(segment, head): (chunks walked, whether the running sum passed within 1e-3
    of ``eps``: where rounding may end the kernel's walk a chunk off)}. A chunk's bound is the sum
    of its g, plus (``delta``) Σ log max(1, |1 − β‖k‖²|) over its rows; the walk goes back from the
    segment's first row (``after``: forward from its end) until the sum is at most ``eps`` or the
    sequence's edge. k [T, H, K], beta and g [T, HV] (CPU), cu the sequences' offsets, seg_cu and
    seq the segments' offsets and sequences (lists)."""
    H = k.shape[1]
    nk = (k.double() ** 2).sum(-1)  # [T, H]
    out = {}
    for s in range(len(seq)):
        sbos, seos = int(cu[seq[s]]), int(cu[seq[s] + 1])
        bos, eos = seg_cu[s], seg_cu[s + 1]
        for hv in range(HV):
            n, acc, near = 0, 0.0, False
            while acc > eps and (eos + n * BT < seos if after else bos - n * BT > sbos):
                r0 = eos + n * BT if after else bos - (n + 1) * BT
                rows = slice(r0, min(r0 + BT, seos))
                acc += float(g[rows, hv].double().sum())
                if delta:
                    stretch = (1 - beta[rows, hv].double() * nk[rows, hv // (HV // H)]).abs().clamp(min=1)
                    acc += float(stretch.log().sum())
                near |= abs(acc - eps) < 1e-3
                n += 1
            out[s, hv] = n, near
    return out
