"""A gdn model under ``torch.compile(mode="reduce-overhead")`` (Inductor's CUDA graph trees) on a
GPU: the compiled step warms its graphs up, records and replays them, and every call's loss and
gradients match the eager model's. The warm-up runs eagerly with the thread's allocations in the
graphs' pool, where a tensor the ops keep beyond the call (the chunk layouts, their segments and
slices) fails the trees' check of that pool. Packed rows (``cu_seqlens``, a new packing each call)
too: their ops read the offsets on the host and run outside the graphs (gdn.ops.library.HOST_READS).
Skipped without a CUDA device (conftest)."""
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


def test_reduce_overhead_packed_rows_match_eager():
    """One packed row of 2048 tokens, its documents cut differently at every call (the training
    CLI's batches): the compiled step's loss and gradients match the eager model's each time."""
    torch.manual_seed(0)
    cfg = GDNConfig.from_preset("gdn", "tiny", hidden_size=256, num_hidden_layers=2, head_dim=128,
                                intermediate_size=512)
    eager = GDNForCausalLM(cfg).cuda()
    compiled_model = copy.deepcopy(eager)
    run = torch.compile(compiled_model, mode="reduce-overhead")
    T = 2048
    ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
    # four offsets each (one compiled shape), the values new at every call
    cuts = ([0, 700, 701, 2048], [0, 64, 1500, 2048], [0, 1000, 1000, 2048], [0, 5, 2047, 2048])

    def step(m, params, cu):
        for p in params:
            p.grad = None
        torch.compiler.cudagraph_mark_step_begin()
        loss = m(input_ids=ids, labels=ids, cu_seqlens=cu, use_cache=False).loss
        loss.backward()
        return loss.detach().clone(), [p.grad.clone() for p in params]

    params = list(compiled_model.parameters())
    for call, cut in enumerate(cuts):
        cu = torch.tensor(cut, dtype=torch.int32, device="cuda")
        ref_loss, ref_grads = step(eager, list(eager.parameters()), cu)
        loss, grads = step(run, params, cu)
        assert rel_err(loss, ref_loss) < 1e-4, (call, loss.item(), ref_loss.item())
        worst = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
        assert worst < 2e-3, (call, worst)
