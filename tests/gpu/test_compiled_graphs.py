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


def _models():
    """A tiny gdn model on the GPU, an identical copy of it, and the copy compiled with CUDA graphs."""
    torch.manual_seed(0)
    cfg = GDNConfig.from_preset("gdn", "tiny", hidden_size=256, num_hidden_layers=2, head_dim=128,
                                intermediate_size=512)
    eager = GDNForCausalLM(cfg).cuda()
    compiled_model = copy.deepcopy(eager)
    return cfg, eager, compiled_model, torch.compile(compiled_model, mode="reduce-overhead")


def _step(m, params, ids, cu=None):
    """One training step's loss and gradients (cloned: a replay overwrites the graphs' outputs)."""
    for p in params:
        p.grad = None
    torch.compiler.cudagraph_mark_step_begin()
    loss = m(input_ids=ids, labels=ids, cu_seqlens=cu, use_cache=False).loss
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in params]


def _assert_matches(call, got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert rel_err(loss, ref_loss) < 1e-4, (call, loss.item(), ref_loss.item())
    worst = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
    assert worst < 2e-3, (call, worst)


@pytest.mark.parametrize("T", [256, 4096], ids=["T256", "T4096"])
def test_reduce_overhead_step_matches_eager(T):
    cfg, eager, compiled_model, run = _models()
    ids = torch.randint(0, cfg.vocab_size, (2, T), device="cuda")
    want = _step(eager, list(eager.parameters()), ids)
    params = list(compiled_model.parameters())
    for call in range(4):  # warm-up, recording, then replays
        _assert_matches(call, _step(run, params, ids), want)


def test_reduce_overhead_packed_rows_match_eager():
    """One packed row of 2048 tokens, its documents cut differently at every call (the training
    CLI's batches): the compiled step's loss and gradients match the eager model's each time."""
    cfg, eager, compiled_model, run = _models()
    ids = torch.randint(0, cfg.vocab_size, (1, 2048), device="cuda")
    # four offsets each (one compiled shape), the values new at every call
    cuts = ([0, 700, 701, 2048], [0, 64, 1500, 2048], [0, 1000, 1000, 2048], [0, 5, 2047, 2048])
    params = list(compiled_model.parameters())
    for call, cut in enumerate(cuts):
        cu = torch.tensor(cut, dtype=torch.int32, device="cuda")
        _assert_matches(call, _step(run, params, ids, cu), _step(eager, list(eager.parameters()), ids, cu))
