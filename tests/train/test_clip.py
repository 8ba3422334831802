"""Clipping inside the fused update (gdn.train.clip) against torch's clip_grad_norm_ then step."""
import pytest
import torch

from gdn.train import clip


def _model_and_grads(seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
            p.grad = scale * torch.randn(p.shape, generator=g)
    return m


def _twins(seed, scale, **opt):
    a, b = _model_and_grads(seed, scale), _model_and_grads(seed, scale)
    return a, torch.optim.AdamW(a.parameters(), lr=0.1, **opt), b, torch.optim.AdamW(b.parameters(), lr=0.1, **opt)


@pytest.mark.parametrize("opt", [dict(fused=True), dict(foreach=True)], ids=["fused", "foreach"])
@pytest.mark.parametrize("scale,max_norm", [(5.0, 1.0), (0.01, 1.0), (5.0, 0.0)], ids=["clipped", "under", "unbounded"])
def test_step_clipped_matches_clip_grad_norm(opt, scale, max_norm):
    a, oa, b, ob = _twins(0, scale, **opt)
    ref = torch.nn.utils.clip_grad_norm_(a.parameters(), max_norm if max_norm > 0 else float("inf"))
    oa.step()
    norm = clip.global_norm(list(b.parameters()))
    assert clip.takes_scale(ob) == ("fused" in opt)
    clip.step_clipped(ob, b.parameters(), max_norm, norm)
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=1e-6, atol=1e-7)  # one division against one product
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-6, atol=1e-7)  # the bounded gradients kept
    assert not hasattr(ob, "grad_scale") and not hasattr(ob, "found_inf")
    if max_norm > 0 and scale > 1:  # the bound bit: the kept gradients are at the bound
        assert abs(float(clip.global_norm(list(b.parameters()))) - max_norm) < 1e-4


def test_found_inf_skips_the_update():
    _, _, b, ob = _twins(1, 5.0, fused=True)
    before = [p.detach().clone() for p in b.parameters()]
    clip.step_clipped(ob, b.parameters(), 1.0, clip.global_norm(list(b.parameters())), found_inf=torch.ones(()))
    for p, q in zip(b.parameters(), before):
        assert torch.equal(p.detach(), q)


def test_found_inf_needs_the_fused_update():
    _, _, b, ob = _twins(2, 1.0, foreach=True)
    with pytest.raises(ValueError, match="found_inf"):
        clip.step_clipped(ob, b.parameters(), 1.0, clip.global_norm(list(b.parameters())), found_inf=torch.zeros(()))


def test_global_norm_without_gradients_is_zero():
    m = torch.nn.Linear(3, 2)
    assert float(clip.global_norm(list(m.parameters()))) == 0.0
