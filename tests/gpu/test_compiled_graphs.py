"""A gdn model under ``torch.compile(mode="reduce-overhead")`` (Inductor's CUDA graph trees) on a
GPU: the compiled step warms its graphs up, records and replays them, and every call's loss and
gradients match the eager model's. The warm-up runs eagerly with the thread's allocations in the
graphs' pool, where a tensor the ops keep beyond the call (the chunk layouts, their segments and
slices) fails the trees' check of that pool. Skipped without a CUDA device (conftest)."""
from __future__ import annotations

import copy

import pytest
import torch

from gdn.models import GDNConfig, GDNForCausalLM

from .helpers import rel_err


@pytest.mark.parametrize("T", [256, 4096], ids=["T256", "T4096"])
def test_reduce_overhead_step_matches_eager(T):
    torch.manual_seed(0)
    cfg = GDNConfig.from_preset("gdn", "tiny", hidden_size=256, num_hidden_layers=2, head_dim=128,
                                intermediate_size=512)
    eager = GDNForCausalLM(cfg).cuda()
    compiled_model = copy.deepcopy(eager)
    run = torch.compile(compiled_model, mode="reduce-overhead")
    ids = torch.randint(0, cfg.vocab_size, (2, T), device="cuda")

    def step(m, params):
        for p in params:
            p.grad = None
        torch.compiler.cudagraph_mark_step_begin()
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach().clone(), [p.grad.clone() for p in params]

    ref_loss, ref_grads = step(eager, list(eager.parameters()))
    params = list(compiled_model.parameters())
    for call in range(4):  # warm-up, recording, then replays
        loss, grads = step(run, params)
        assert rel_err(loss, ref_loss) < 1e-4, (call, loss.item(), ref_loss.item())
        worst = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
        assert worst < 2e-3, (call, worst)
