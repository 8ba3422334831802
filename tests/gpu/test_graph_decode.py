"""CUDA-graph decode (gdn.models.GraphDecoder) on a GPU: the captured static step, replayed per
token, gives the eager decode's greedy tokens, for the presets of tests/test_static_cache.py, in
fp32 and bf16, with a batch padded up to its bucket, and with slots refilled as sequences finish;
``model.generate`` with
``cache_implementation="static"`` gives transformers' eager tokens for every preset (the CPU
counterpart is tests/test_graph_generate.py). Skipped without a CUDA device (conftest)."""
from __future__ import annotations

import pytest
import torch

from gdn.generation import decode_step, generate, generate_slots, prefill
from gdn.models import PRESETS, GDNConfig, GDNForCausalLM, GraphDecoder

NEW = 16
CASES = [("gdn", {}), ("gdn-h1", {"window_size": 4}), ("transformer", {}), ("gdn", {"layer_pattern": "KM"}),
         ("gdn", {"layer_pattern": "GSA", "num_hidden_layers": 3, "window_size": 4})]
IDS = ["gdn", "gdn-h1", "transformer", "KM", "GSA"]


def tiny(preset, dtype, **kw):
    torch.manual_seed(0)
    kw = {"hidden_size": 32, "num_hidden_layers": 2, "head_dim": 16, "intermediate_size": 64, **kw}
    return GDNForCausalLM(GDNConfig.from_preset(preset, "tiny", **kw)).to("cuda", dtype).eval()


@pytest.mark.parametrize("preset,kw", CASES, ids=IDS)
def test_graph_equals_eager(preset, kw):
    """fp32: greedy tokens equal and logits close at every step, batch 3 in bucket 4, left-padded."""
    m = tiny(preset, torch.float32, **kw)
    ids = torch.randint(1, m.config.vocab_size, (3, 9), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    logits, cache = prefill(m, ids, mask)
    dec = GraphDecoder(m, max_length=9 + NEW)
    assert dec.use_graph
    dec.start(cache.snapshot())
    t_eager = t_graph = logits.argmax(-1)
    for _ in range(NEW):
        a = decode_step(m, t_eager, cache)
        b = dec.step(t_graph)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        t_eager, t_graph = a.argmax(-1), b.argmax(-1)
        assert torch.equal(t_eager, t_graph)
    torch.cuda.synchronize()


@pytest.mark.parametrize("preset,kw", CASES, ids=IDS)
def test_generate_graph_reused(preset, kw):
    """``generate(..., graph=decoder)`` twice on one decoder (graphs captured once, buffers reloaded)
    and at two batch sizes gives the eager greedy tokens (fp32; bf16 runs)."""
    m = tiny(preset, torch.float32, **kw)
    ids = torch.randint(1, m.config.vocab_size, (2, 8), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))
    ref = generate(m, ids, max_new_tokens=NEW)
    dec = GraphDecoder(m, max_length=64)
    assert torch.equal(generate(m, ids, max_new_tokens=NEW, graph=dec), ref)
    assert torch.equal(generate(m, ids, max_new_tokens=NEW, graph=dec), ref)
    assert torch.equal(generate(m, ids[:1], max_new_tokens=NEW, graph=dec), ref[:1])
    # bf16: the graph runs (near-ties of a random tiny model may flip later greedy tokens between
    # the two attention layouts, so only the shape and the prefill's token are compared)
    mb = tiny(preset, torch.bfloat16, **kw)
    refb = generate(mb, ids, max_new_tokens=4)
    outb = generate(mb, ids, max_new_tokens=4, graph=True)
    assert outb.shape == refb.shape and torch.equal(outb[:, :9], refb[:, :9])


@pytest.mark.parametrize("preset,kw", CASES, ids=IDS)
def test_slots_refilled_on_the_graph(preset, kw):
    """``generate_slots(..., graph=decoder)``: newcomers written into the rows of the captured batch
    (a long prompt arriving after short ones moves global attention rows), finished rows released;
    fp32 greedy tokens equal the eager slots' and the bucket's graph is captured once."""
    m = tiny(preset, torch.float32, **kw)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, m.config.vocab_size, (n,), generator=g).tolist()
               for n in (3, 2, 4, 50, 1, 70, 6, 2, 9, 1, 33)]
    limits = [3, 9, 1, 12, 6, 4, 8, 2, 11, 5, 7]
    ref = generate_slots(m, prompts, max_new_tokens=limits, batch_size=3)
    eos = ref[3][2]
    ref = generate_slots(m, prompts, max_new_tokens=limits, batch_size=3, eos_token_id=eos)
    dec = GraphDecoder(m, max_length=8)
    assert generate_slots(m, prompts, max_new_tokens=limits, batch_size=3, eos_token_id=eos, graph=dec) == ref
    graph = dec._buckets[4].graph
    assert graph is not None and dec.use_graph
    assert generate_slots(m, prompts, max_new_tokens=limits, batch_size=3, eos_token_id=eos, graph=dec) == ref
    assert dec._buckets[4].graph is graph
    torch.cuda.synchronize()


def _near_argmax(logits: torch.Tensor, tokens: torch.Tensor, tol: float = 1e-3) -> bool:
    """Every chosen token's logit is within ``tol`` of its row's best (the argmax, or a near tie that
    another summation order may break the other way)."""
    best = logits.max(-1).values
    chosen = logits.gather(-1, tokens[..., None])[..., 0]
    return bool(((best - chosen) <= tol * best.abs().clamp(min=1)).all())


@pytest.mark.parametrize("preset", list(PRESETS))
def test_model_generate_static_cache(preset):
    """``model.generate`` with ``generation_config.cache_implementation = "static"``, every preset at
    the tiny size in fp32, a left-padded batch of 3: the graph decoder captured CUDA graphs, its greedy
    tokens equal transformers' eager loop, and one full forward over the result picks them too (up to
    near ties); a second call replays the same graph; an eos that ends every row early stops both paths
    at the same length (the stop flag is read one step late on CUDA)."""
    torch.manual_seed(0)
    m = GDNForCausalLM(GDNConfig.from_preset(preset, "tiny")).to("cuda").eval()
    T = 9
    ids = torch.randint(1, m.config.vocab_size, (3, T), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    ref = m.generate(ids, **kw)
    assert m.graph_decoder is None
    m.generation_config.cache_implementation = "static"
    out = m.generate(ids, **kw)
    dec = m.graph_decoder
    assert dec is not None and dec.use_graph
    bucket = dec._buckets[dec.bucket(3)]
    assert bucket.graph is not None
    assert torch.equal(out, ref)
    with torch.no_grad():
        full = m(out[:, :-1], attention_mask=torch.cat([mask, torch.ones_like(out[:, T:-1])], 1)).logits.float()
    assert _near_argmax(full[:, T - 1:], out[:, T:])
    graph = bucket.graph
    assert torch.equal(m.generate(ids, **kw), ref)
    assert m.graph_decoder is dec and bucket.graph is graph
    # eos: every row's own third token, so all finish after three steps
    eos_row = ids[:1]
    one = m.generate(eos_row, max_new_tokens=NEW, do_sample=False, cache_implementation=None)
    eos = int(one[0, T + 2])
    short_ref = m.generate(eos_row, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, cache_implementation=None)
    short = m.generate(eos_row, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    first = (one[0, T:] == eos).nonzero()[0, 0].item()
    assert short.shape[1] == short_ref.shape[1] == T + first + 1
    assert torch.equal(short, short_ref)
    torch.cuda.synchronize()


def test_model_generate_static_sampling_and_bf16():
    """Sampling on the graph draws the eager samples from one seed (fp32); bf16 runs through the
    graph path and returns the requested length."""
    torch.manual_seed(0)
    m = GDNForCausalLM(GDNConfig.from_preset("gdn-h1", "tiny")).to("cuda").eval()
    ids = torch.randint(1, m.config.vocab_size, (4, 12), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(3))
    kw = dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=50, top_p=0.95)
    m.generate(ids, max_new_tokens=2, cache_implementation="static")  # capture outside the compared calls
    torch.manual_seed(5)
    ref = m.generate(ids, **kw)
    torch.manual_seed(5)
    out = m.generate(ids, cache_implementation="static", **kw)
    assert m.graph_decoder.use_graph and torch.equal(out, ref)
    mb = GDNForCausalLM(GDNConfig.from_preset("gdn-h1", "tiny")).to("cuda", torch.bfloat16).eval()
    outb = mb.generate(ids, max_new_tokens=NEW, do_sample=False, cache_implementation="static")
    assert outb.shape == (4, 12 + NEW) and mb.graph_decoder.use_graph
    torch.cuda.synchronize()
