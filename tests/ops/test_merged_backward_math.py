"""The merged backward's arithmetic (gdn.ops.delta.triton.fused_rbwd), chunk by chunk as its roles
form it, in float64 torch against autograd through the token recurrence. Gluon has no interpreter,
so this checks the formulas the kernel is written from (which products, masks and row sums each
role takes, the chunk's tail term A's) on the CPU; the GPU tests check the kernel
itself. The rows of a chunk's block past its sequence's end hold unrelated finite values, as the
kernel's tensor copies bring them in, so the masks are what keeps them out."""
from __future__ import annotations

import pytest
import torch

from gdn.ops.delta import reference

C = 64


def _blocks(x, n, fill):
    """x [n, ...] padded to the next multiple of C rows with ``fill``'s rows (garbage stand-ins)."""
    pad = (-n) % C
    return torch.cat([x, fill[:pad]]) if pad else x


def merged_backward(q, k, v, g, beta, h0, do, dht, scale):
    """One sequence and head, float64: (dq, dk, dv, dg, dβ, dh0), the forward recomputed chunk by
    chunk (h, δ, T as the backward's state pass leaves them), then the reverse walk with the
    kernel's per-chunk formulas."""
    T_, K = k.shape
    V = v.shape[1]
    gen = torch.Generator().manual_seed(7)
    junk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    nc = (T_ + C - 1) // C
    qb, kb, vb, dob = (_blocks(x, T_, junk(C, x.shape[1])) for x in (q, k, v, do))
    gb, bb = _blocks(g, T_, junk(C)), _blocks(beta, T_, junk(C).abs())
    r = torch.arange(C)
    # the forward's per-chunk pieces (valid rows only: what kkt_solve and the state pass write)
    S = h0.clone()
    hs, deltas, Ts, gams = [], [], [], []
    for c in range(nc):
        s = slice(c * C, (c + 1) * C)
        n = min(C, T_ - c * C)
        m = r < n
        gam = torch.where(m, torch.cumsum(torch.where(m, gb[s], 0.0), 0), 0.0)
        D = torch.where((r[:, None] >= r[None, :]) & m[:, None] & m[None, :], torch.exp(gam[:, None] - gam[None, :]),
                        0.0)
        A = torch.tril(bb[s][:, None] * (kb[s] @ kb[s].T) * D, -1) * m[:, None] * m[None, :]
        Tm = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A) * m[:, None]
        delta = Tm @ (bb[s][:, None] * (vb[s] - torch.exp(gam)[:, None] * (kb[s] @ S))) * m[:, None]
        hs.append(S.clone())
        # rows past the end as the copies bring them: δ of the next sequence (finite), T likewise
        deltas.append(torch.where(m[:, None], delta, junk(C, V)))
        Ts.append(torch.where(m[:, None], Tm, torch.tril(junk(C, C))))
        gams.append(gam)
        gC = gam[n - 1]
        S = torch.exp(gC) * S + kb[s].T @ (torch.exp(gC - gam)[:, None] * m[:, None] * delta)
    # the reverse walk
    dq, dk, dv = torch.zeros(T_, K, dtype=torch.float64), torch.zeros(T_, K, dtype=torch.float64), torch.zeros(
        T_, V, dtype=torch.float64)
    dg, db = torch.zeros(T_, dtype=torch.float64), torch.zeros(T_, dtype=torch.float64)
    dS = dht.clone()
    for c in reversed(range(nc)):
        s = slice(c * C, (c + 1) * C)
        n = min(C, T_ - c * C)
        m = r < n
        Q, Kk, Vv, dO, d, Tm, Sh = qb[s], kb[s], vb[s], dob[s], deltas[c], Ts[c], hs[c]
        gam, b = gams[c], torch.where(m, bb[s], 0.0)
        gC = gam[n - 1]
        Dt = torch.where((r[None, :] >= r[:, None]) & m[None, :], torch.exp(gam[None, :] - gam[:, None]), 0.0)
        D = torch.where((r[:, None] >= r[None, :]) & m[:, None], torch.exp(gam[:, None] - gam[None, :]), 0.0)
        strict = (r[:, None] > r[None, :]) & m[:, None]
        # A: for the chain
        Pt = (Kk @ Q.T) * Dt
        L = scale * Pt @ dO
        dOt = torch.where(m, scale * torch.exp(gam), 0.0)[:, None] * dO
        # B: for the chain
        w = torch.where(m, torch.exp(gC - gam), 0.0)
        dd = w[:, None] * (Kk @ dS) + L
        Y = Tm.T @ dd
        Z = -(b * torch.exp(gam))[:, None] * Y
        # A: its gradients before B's hand-over (the pair terms, dQ, dK's state term)
        dsm = (dO @ d.T) * D * scale
        bqk = (Q @ Kk.T) * dsm
        dg_t = bqk.sum(1)
        dg_c = -bqk.sum(0)
        dg_c[n - 1] += torch.exp(gC) * (Sh * dS).sum()
        dqs = torch.where(m, scale * torch.exp(gam), 0.0)[:, None] * (dO @ Sh.T)
        dg_t = dg_t + (Q * dqs).sum(1)
        dQ = dsm @ Kk + dqs
        dks = w[:, None] * (d @ dS.T)
        b_a = (Kk * dks).sum(1)
        dg_c[n - 1] += b_a.sum()
        # B: its gradients
        dV = b[:, None] * Y
        dbu = (torch.where(m[:, None], Vv, 0.0) * Y).sum(1)
        dW = -dd @ Sh.T
        da = Tm.T @ (dd @ d.T)
        kk = Kk @ Kk.T
        dA = -torch.where(strict, da * D, 0.0)
        dbeta = (dA * kk).sum(1)
        M = b[:, None] * dA
        e2 = M * kk
        dg_t = dg_t + e2.sum(1)
        dg_c = dg_c - e2.sum(0)
        # A: dK once B has handed over M and dW
        tdw = Tm.T @ dW
        ktdw = (Kk * tdw).sum(1)
        dK = dks + (b * torch.exp(gam))[:, None] * tdw + dsm.T @ Q + M @ Kk + M.T @ Kk
        dbeta = dbeta + ktdw * torch.exp(gam) + dbu
        dg_k = ktdw * b * torch.exp(gam) - b_a
        dg_c = dg_c + dg_t + dg_k
        dgam = torch.flip(torch.cumsum(torch.flip(dg_c, [0]), 0), [0])
        # the chain
        dS = torch.exp(gC) * dS + Q.T @ dOt + Kk.T @ Z
        rows = slice(c * C, c * C + n)
        dq[rows], dk[rows], dv[rows] = dQ[:n], dK[:n], dV[:n]
        dg[rows], db[rows] = dgam[:n], dbeta[:n]
    return dq, dk, dv, dg, db, dS


@pytest.mark.parametrize("T", [1, 40, 64, 150, 200])
def test_merged_formulas_match_autograd(T):
    K, V = 8, 6
    torch.manual_seed(T)
    f64 = torch.float64
    q = torch.randn(T, K, dtype=f64)
    k = torch.nn.functional.normalize(torch.randn(T, K, dtype=f64), dim=-1)
    v = torch.randn(T, V, dtype=f64)
    g = torch.nn.functional.logsigmoid(torch.randn(T, dtype=f64) + 2)
    beta = torch.rand(T, dtype=f64)
    h0 = torch.randn(K, V, dtype=f64)
    do, dht = torch.randn(T, V, dtype=f64), torch.randn(K, V, dtype=f64)
    scale = K ** -0.5
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, ht = reference.gated_delta_rule(xs[0][None, :, None], xs[1][None, :, None], xs[2][None, :, None],
                                       xs[3][None, :, None], xs[4][None, :, None], scale=scale,
                                       initial_state=xs[5][None, None], output_final_state=True)
    ((o[0, :, 0] * do).sum() + (ht[0, 0] * dht).sum()).backward()
    got = merged_backward(q, k, v, g, beta, h0, do, dht, scale)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, [x.grad for x in xs]):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-9), (name, (a - b).abs().max())
