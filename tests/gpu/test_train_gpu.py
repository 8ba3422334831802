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
