"""The memory-saving autograd Functions against the plain PyTorch forms they replace:
float64 gradcheck of every custom backward, equality with the autograd of the plain form (fp32
and under bf16 autocast), what each one keeps for the backward, and the model's chunked loss
against the full-logits cross entropy."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gdn.layers import GatedRMSNorm, RMSNorm, ShortConvolution, SwiGLU
from gdn.ops.conv import ConvActFn as _ConvActFn
from gdn.ops.swiglu import SwiGLUDownFn
from gdn.ops.norm import GatedRMSNormFn as _GatedRMSNormFn
from gdn.ops.norm import RMSNormFn as _RMSNormFn
from gdn.models import GDNConfig, GDNForCausalLM
from gdn.ops import loss as L


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def rnd(*shape, seed=0, dtype=torch.float64, grad=True):
    return torch.randn(*shape, generator=gen(seed), dtype=dtype).requires_grad_(grad)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def plain_rms(x, w, eps):
    xf = x.float() if x.dtype != torch.float64 else x
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(xf.dtype)


def plain_conv(x, w, hist, activation):
    xp = torch.cat([hist, x.transpose(1, 2)], -1)
    y = F.conv1d(xp, w.to(x.dtype)[:, None, :], groups=x.shape[-1]).transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


def saved_bytes(fn, *args):
    """Bytes (storages counted once, parameters/inputs included) saved for backward by fn(*args)."""
    seen, total = set(), [0]

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total[0] += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return total[0], out


# ---------------------------------------------------------------- float64 gradchecks

def test_rmsnorm_gradcheck():
    x, w = rnd(3, 5, 7), rnd(7, seed=1)
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormFn.apply(x, w, 1e-6, torch.float64), (x, w))


def test_gated_rmsnorm_gradcheck():
    x, gate, w = rnd(2, 4, 3, 6), rnd(2, 4, 3, 6, seed=1), rnd(6, seed=2)
    assert torch.autograd.gradcheck(lambda x, g, w: _GatedRMSNormFn.apply(x, g, w, 1e-6), (x, gate, w))


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("packed", [False, True])
def test_conv_gradcheck(activation, packed):
    x, w = rnd(1, 9, 5), rnd(5, 4, seed=1)
    if packed:
        cu = torch.tensor([0, 2, 7, 9])
        fn = lambda x, w: _ConvActFn.apply(x, w, None, cu, activation)  # noqa: E731
        args = (x, w)
    else:
        hist = rnd(1, 5, 3, seed=2)
        fn = lambda x, w, h: _ConvActFn.apply(x, w, h, None, activation)  # noqa: E731
        args = (x, w, hist)
    assert torch.autograd.gradcheck(fn, args)


def test_swiglu_down_gradcheck():
    gate, up, w = rnd(2, 3, 6), rnd(2, 3, 6, seed=1), rnd(4, 6, seed=2)
    assert torch.autograd.gradcheck(lambda g, u, w: SwiGLUDownFn.apply(g, u, w, torch.float64), (gate, up, w))


def test_linear_cross_entropy_gradcheck(monkeypatch):
    monkeypatch.setattr(L, "CHUNK_ELEMENTS", 22)  # 2 rows of an 11-class vocabulary per chunk: 4 chunks
    h, w = rnd(7, 5), rnd(11, 5, seed=1)
    t = torch.tensor([3, -100, 0, 10, 4, -100, 7])
    assert torch.autograd.gradcheck(lambda h, w: L.linear_cross_entropy(h, w, t), (h, w))


# ---------------------------------------------------------------- against the plain forms

def grads(out, inputs, seed=5):
    dy = torch.randn(out.shape, generator=gen(seed)).to(out.dtype)
    return torch.autograd.grad(out, inputs, dy)


def test_modules_match_plain_autograd_fp32():
    torch.manual_seed(0)
    x = rnd(2, 13, 16, dtype=torch.float32)
    norm = RMSNorm(16)
    norm.weight.data.uniform_(0.5, 1.5)
    y = norm(x)
    ref = plain_rms(x, norm.weight, norm.eps)
    assert torch.equal(y, ref)
    for a, b in zip(grads(y, (x, norm.weight)), grads(ref, (x, norm.weight))):
        assert rel(a, b) < 1e-6

    gn = GatedRMSNorm(16)
    gn.weight.data.uniform_(0.5, 1.5)
    g = rnd(2, 13, 16, seed=3, dtype=torch.float32)
    y = gn(x, g)
    ref = plain_rms(x, gn.weight, gn.eps) * F.silu(g)
    assert torch.equal(y, ref)
    for a, b in zip(grads(y, (x, g, gn.weight)), grads(ref, (x, g, gn.weight))):
        assert rel(a, b) < 1e-6

    conv = ShortConvolution(16, 4)
    hist = rnd(2, 16, 3, seed=4, dtype=torch.float32)
    y, _ = conv(x, state=hist)
    ref = plain_conv(x, conv.weight, hist, "silu")
    assert torch.equal(y, ref)
    for a, b in zip(grads(y, (x, conv.weight, hist)), grads(ref, (x, conv.weight, hist))):
        assert rel(a, b) < 1e-6

    mlp = SwiGLU(16, 40)
    y = mlp(x)
    ref = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert rel(y, ref) < 1e-6  # (gate and up from one product of the joined weights: other roundings)
    ps = (x, *mlp.parameters())
    for a, b in zip(grads(y, ps), grads(ref, ps)):
        assert rel(a, b) < 1e-6


def test_modules_match_plain_autograd_under_bf16_autocast():
    """Same forward bits and gradients within bf16 rounding, the norm returning the autocast dtype."""
    torch.manual_seed(0)
    x = rnd(2, 33, 32, dtype=torch.float32)
    norm, mlp, conv = RMSNorm(32), SwiGLU(32, 64), ShortConvolution(64, 4)
    params = (x, norm.weight, *mlp.parameters(), conv.weight)

    def ours():
        h = norm(x)
        assert h.dtype == torch.bfloat16
        return conv(mlp(h).repeat(1, 1, 2))[0]

    def plain():
        h = plain_rms(x, norm.weight, norm.eps).to(x.dtype)
        m = mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h)).repeat(1, 1, 2)
        hist = m.new_zeros(2, 64, 3)
        return plain_conv(m, conv.weight, hist, "silu")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = ours(), plain()
    assert a.dtype == b.dtype == torch.bfloat16
    assert torch.equal(a, b)
    for ga, gb in zip(grads(a, params), grads(b, params)):
        assert rel(ga, gb) < 1e-2


def test_gated_norm_matches_under_autocast():
    x, g = rnd(3, 7, 2, 16, dtype=torch.bfloat16), rnd(3, 7, 2, 16, seed=1, dtype=torch.bfloat16)
    gn = GatedRMSNorm(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gn(x, g)
        ref = (plain_rms(x, gn.weight, gn.eps) * F.silu(g.float())).to(x.dtype)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    for a, b in zip(grads(y, (x, g, gn.weight)), grads(ref, (x, g, gn.weight))):
        assert rel(a, b) < 1e-2


# ---------------------------------------------------------------- what is kept for the backward

def test_each_function_keeps_only_its_inputs_and_rstd():
    B, T, D, I = 2, 64, 32, 96  # noqa: E741
    x = rnd(B, T, D, dtype=torch.float32)
    norm = RMSNorm(D)
    nb, _ = saved_bytes(norm, x)
    assert nb == x.nbytes + norm.weight.nbytes + B * T * 4  # x, weight, fp32 rstd

    gn = GatedRMSNorm(D)
    g = rnd(B, T, D, seed=1, dtype=torch.float32)
    nb, _ = saved_bytes(gn, x, g)
    assert nb == x.nbytes + g.nbytes + gn.weight.nbytes + B * T * 4

    conv = ShortConvolution(D, 4)
    nb, _ = saved_bytes(lambda t: conv(t)[0], x)
    assert nb == x.nbytes + conv.weight.nbytes + B * D * 3 * 4  # x, weight, zero history

    gate, up = rnd(B, T, I, dtype=torch.float32), rnd(B, T, I, seed=1, dtype=torch.float32)
    w = rnd(D, I, seed=2, dtype=torch.float32)
    nb, _ = saved_bytes(SwiGLUDownFn.apply, gate, up, w, torch.float32)
    assert nb == gate.nbytes + up.nbytes + w.nbytes


def test_norm_output_is_shared_by_the_projections_under_autocast():
    """One bf16 copy of the normalised input is saved, however many projections read it."""
    D = 32
    x = rnd(2, 16, D, dtype=torch.float32)
    norm = RMSNorm(D)
    projs = [torch.nn.Linear(D, 24, bias=False) for _ in range(4)]

    def run(t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = norm(t)
            return sum(p(h).float().sum() for p in projs)

    nb, _ = saved_bytes(run, x)
    weights = sum(p.weight.numel() * 2 for p in projs)  # autocast's bf16 weight copies
    assert nb == x.nbytes + norm.weight.nbytes + 2 * 16 * 4 + x.numel() * 2 + weights


def test_loss_keeps_no_vocab_sized_tensor():
    """The loss keeps its two gradients, formed in the forward (h's size and the weight's), and no
    [N, vocab] tensor; under no_grad it forms and keeps nothing for a backward."""
    N, D, V = 64, 16, 1000
    h, w = rnd(N, D, dtype=torch.float32), rnd(V, D, seed=1, dtype=torch.float32)
    t = torch.randint(0, V, (N,), generator=gen(2))
    nb, _ = saved_bytes(L.linear_cross_entropy, h, w, t)
    assert nb == h.nbytes + w.nbytes
    with torch.no_grad():
        nb, _ = saved_bytes(L.linear_cross_entropy, h, w, t)
    assert nb == 0
    nb, _ = saved_bytes(L.linear_cross_entropy, h.detach(), w, t)  # the weight's gradient alone
    assert nb == w.nbytes


def test_loss_forms_the_logits_once(monkeypatch):
    """Forward + backward run three products of the head's size a chunk (the logits, then dh and dw
    from them), none in the backward: the logits are not formed again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                self.n += 1
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(L, "CHUNK_ELEMENTS", 4 * 50)  # four rows a chunk: 6 chunks of 23 rows
    N, D, V = 23, 8, 50
    h, w = rnd(N, D, dtype=torch.float32), rnd(V, D, seed=1, dtype=torch.float32)
    t = torch.randint(0, V, (N,), generator=gen(2))
    fwd, bwd = Products(), Products()
    with fwd:
        loss = L.linear_cross_entropy(h, w, t)
    with bwd:
        loss.backward()
    assert (fwd.n, bwd.n) == (3 * 6, 0)


# ---------------------------------------------------------------- the model's loss

def test_linear_cross_entropy_matches_cross_entropy(monkeypatch):
    monkeypatch.setattr(L, "CHUNK_ELEMENTS", 3 * 50)  # several chunks and a ragged last one
    N, D, V = 23, 8, 50
    h, w = rnd(N, D, dtype=torch.float32), rnd(V, D, seed=1, dtype=torch.float32)
    t = torch.randint(0, V, (N,), generator=gen(2))
    t[[0, 5, 6]] = -100
    loss = L.linear_cross_entropy(h, w, t)
    ref = F.cross_entropy(h @ w.t(), t, ignore_index=-100)
    assert abs(loss.item() - ref.item()) < 1e-5
    for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
        assert rel(a, b) < 1e-5
    assert torch.isnan(L.linear_cross_entropy(h, w, torch.full((N,), -100)))
    with pytest.raises(ValueError, match="target"):
        L.linear_cross_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="weight"):
        L.linear_cross_entropy(h, w[:, :-1], t)
    with pytest.raises(ValueError, match="h must"):
        L.linear_cross_entropy(h[None], w, t)


def tiny_model(**kw):
    torch.manual_seed(0)
    cfg = GDNConfig.from_preset("gdn-h1", hidden_size=64, vocab_size=97, num_hidden_layers=2, window_size=8, **kw)
    return GDNForCausalLM(cfg)


@pytest.mark.parametrize("tie", [False, True])
def test_training_loss_and_gradients_equal_the_full_logits_path(tie):
    m = tiny_model(tie_word_embeddings=tie)
    x = torch.randint(1, 97, (2, 19), generator=gen(3))
    cu_x, cu = torch.randint(1, 97, (1, 30), generator=gen(4)), torch.tensor([0, 11, 30])
    for kw in ({"input_ids": x, "labels": x}, {"input_ids": cu_x, "labels": cu_x, "cu_seqlens": cu}):
        m.eval()  # full logits + F.cross_entropy
        ref = m(**kw)
        ref.loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad()
        m.train()  # chunked head + loss, no logits
        out = m(**kw)
        assert out.logits is None
        out.loss.backward()
        assert abs(out.loss.item() - ref.loss.item()) < 1e-5
        for n, p in m.named_parameters():
            assert rel(p.grad, ref_grads[n]) < 1e-5, n
        m.zero_grad()


def test_bf16_autocast_training_loss_is_close_to_the_fp32_one():
    m = tiny_model().train()
    x = torch.randint(1, 97, (2, 24), generator=gen(5))
    ref = m(input_ids=x, labels=x).loss
    ref.backward()
    g_ref = m.model.embed_tokens.weight.grad.clone()
    m.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(input_ids=x, labels=x).loss
    loss.backward()
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) < 2e-2
    assert rel(m.model.embed_tokens.weight.grad, g_ref) < 5e-2


# ---------------------------------------------------------------- the whole model against its floor

def test_memory_benchmark_every_layer_role_keeps_its_floor():
    """benchmarks/memory.py on the tiny preset: each role of a Gated DeltaNet block keeps what its
    floor says (the convs' zero history aside), and the loss keeps its two gradients: h's and the
    head weight's (fp32), no [tokens, vocabulary] tensor."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "memory.py"
    spec = importlib.util.spec_from_file_location("bench_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    B, T = 2, 64
    a = bench.parse_args(["--size", "tiny", "--seq-len", str(T), "--batch", str(B), "--layers", "2"])
    cfg, _, ledger = bench.measure(a)
    floors = bench.floors(cfg, 2, 4)
    W = cfg.conv_size - 1
    for role, f in floors.items():
        for layer in range(2):
            got = ledger.bytes.get((role, layer), 0)
            want = f * B * T
            if role.endswith("_conv"):  # plus the zero history [B, D, K-1] it starts from (D = f / 2 bytes)
                want += B * (f // 2) * W * 2
            assert got == want, (role, layer, got, want)
    head = bench.head_floor(cfg, 2, 4)
    assert ledger.bytes[("(top)", -1)] == head["(top)"] * B * T
    assert ledger.bytes[("(the head's weight gradient)", -1)] == cfg.vocab_size * cfg.hidden_size * 4
    assert ledger.bytes[("model.norm", -1)] == head["model.norm"] * B * T


def test_l2_normalise_matches_plain_form_and_gradcheck():
    """gdn.layers.recurrent.l2_normalise (a Function keeping x and the row scale): fp64 gradcheck,
    and the same values and gradients as the plain autograd expression in fp32 and bf16."""
    from gdn.ops.gates import l2_normalise

    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: l2_normalise(t), (x,))
    for dt, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        a = torch.randn(4, 7, 16).to(dt).requires_grad_(True)
        b = a.detach().clone().requires_grad_(True)
        dy = torch.randn(4, 7, 16).to(dt)
        ya = l2_normalise(a)
        bf = b.float()
        yb = (bf * torch.rsqrt(bf.pow(2).sum(-1, keepdim=True) + 1e-6)).to(dt)
        assert ya.dtype == dt and torch.allclose(ya.float(), yb.float(), atol=tol, rtol=tol)
        (ya * dy).sum().backward()
        (yb * dy).sum().backward()
        assert torch.allclose(a.grad.float(), b.grad.float(), atol=tol, rtol=tol)
    z = torch.zeros(2, 4, requires_grad=True)
    out = l2_normalise(z)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(2, 4)) and torch.isfinite(z.grad).all()
