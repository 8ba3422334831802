"""The training loop's optimizer on a CUDA device: torch's fused AdamW, whose steps match the
multi-tensor form's."""
from __future__ import annotations

import torch

from gdn.train.loop import adamw


def test_adamw_on_cuda_is_fused_and_steps_as_the_multi_tensor_form():
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Linear(32, 32)).cuda()  # noqa: E731
    a, b = make(), make()
    b.load_state_dict(a.state_dict())
    opt_a = adamw(a, 1e-2, 0.1, (0.9, 0.95))
    assert opt_a.defaults["fused"]
    names = {id(p): n for n, p in a.named_parameters()}
    b_params = dict(b.named_parameters())
    # adamw's own decay groups, over b's parameters, as the multi-tensor form
    opt_b = torch.optim.AdamW([{**{k: v for k, v in g.items() if k not in ("params", "fused", "foreach")},
                                "params": [b_params[names[id(p)]] for p in g["params"]]}
                               for g in opt_a.param_groups], foreach=True)
    ids = torch.randint(0, 50, (4, 9), device="cuda")
    for _ in range(5):
        for m, opt in ((a, opt_a), (b, opt_b)):
            m(ids).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-5, atol=1e-6), n


def test_a_graphed_step_trains_as_the_eager_step_and_skips_a_non_finite_one():
    """GraphedStep (two eager steps, the capture, then replays) against the same steps run eagerly,
    on a small gdn model in fp32 with the fused AdamW: the weights after six steps agree, the
    losses too, and the step whose loss is NaN (scaled by a NaN in its batch) applies no update,
    captured as eagerly."""
    from gdn.models import GDNConfig, GDNForCausalLM
    from gdn.train.graphs import GraphedStep

    cfg = GDNConfig.from_preset("gdn", "tiny", vocab_size=64)
    torch.manual_seed(0)
    a = GDNForCausalLM(cfg).cuda()
    b = GDNForCausalLM(cfg).cuda()
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-3, fused=True)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3, fused=True)

    def loss_fn(m, batch):
        return m(input_ids=batch["ids"], labels=batch["ids"]).loss * batch["scale"]

    gs = GraphedStep(b, opt_b, loss_fn=loss_fn, grad_clip=1.0, warmup=2)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for i in range(6):
        batch = {"ids": torch.randint(0, 64, (2, 96), device="cuda", generator=gen),
                 "scale": torch.tensor(float("nan") if i == 4 else 1.0, device="cuda")}
        before = [p.detach().clone() for p in b.parameters()]
        opt_a.zero_grad(set_to_none=True)
        la = loss_fn(a, batch)
        la.backward()
        na = torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
        if torch.isfinite(la) and torch.isfinite(na):
            opt_a.step()
        lb, nb = gs(batch)
        torch.cuda.synchronize()
        if i == 4:
            assert not torch.isfinite(lb)
            assert all(torch.equal(p, q) for p, q in zip(before, b.parameters()))
        else:
            assert torch.allclose(la.detach().float(), lb, rtol=1e-4), (i, float(la), float(lb))
            assert torch.allclose(na, nb, rtol=1e-3), (i, float(na), float(nb))
    assert gs.graph is not None and gs.calls == 6
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-4, atol=1e-5), n
