"""``model.generate()`` with ``cache_implementation="static"`` (gdn.models.graph_generate): the
decode runs on the GraphDecoder's static step (on the CPU eagerly, the very step a CUDA graph
captures) and gives what transformers' own loop on the eager GDNCache gives: the same greedy
tokens for every preset (left padding, eos, padding after eos), the same samples from the same
seed, the same scores, processors, stopping criteria and streamer calls; options it cannot honour
fall back with one warning naming them. tests/gpu/test_graph_decode.py runs the same on CUDA graphs."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from gdn.models import PRESETS, GDNConfig, GDNForCausalLM, GraphDecoder

NEW = 10


def tiny(preset, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    return GDNForCausalLM(GDNConfig.from_preset(preset, "tiny", **kw)).to(dtype).eval()


def batch(B=3, T=7, seed=0, vocab=256):
    """Left-padded prompts: row b has b % 3 padding slots (token 0)."""
    ids = torch.randint(1, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(B):
        mask[b, : b % 3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def both(model, *args, **kwargs):
    """(eager output, graph output) of one generate call; the graph call must raise no warning and
    must have run on the model's graph decoder."""
    model.graph_decoder = None
    ref = model.generate(*args, **kwargs)
    assert model.graph_decoder is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model.generate(*args, cache_implementation="static", **kwargs)
    return ref, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_greedy_equals_eager_with_padding_and_eos(preset, dtype):
    """Every preset: a left-padded batch of 3 decodes the eager tokens; with an eos that one row
    produces early, that row is padded after it, the others go on, and both paths agree."""
    m = tiny(preset, dtype)
    ids, mask = batch()
    ref, out = both(m, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref) and out.shape == (3, 7 + NEW)
    assert m.graph_decoder is not None and m.graph_decoder.static_cache.length == 7 + NEW - 1
    eos = int(ref[0, 7 + 2])  # row 0's third new token
    ref, out = both(m, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                    eos_token_id=eos)
    assert torch.equal(out, ref)
    first = (ref[0, 7:] == eos).nonzero()[0, 0].item()
    assert first <= 2 and (ref[0, 7 + first + 1:] == 0).all()
    assert (ref[:, 7:] != eos).any(1).sum() >= 1  # not everything is eos: the others continued


def test_config_set_once_and_mask_inferred_from_padding():
    """``model.generation_config.cache_implementation = "static"`` makes every later call use the graph
    decoder; without an attention_mask, transformers infers it from pad_token_id on both paths."""
    m = tiny("gdn-h1")
    ids, _ = batch(B=3, T=6, seed=3)
    ref = m.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    m.generation_config.cache_implementation = "static"
    out = m.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    dec = m.graph_decoder
    assert dec is not None and torch.equal(out, ref)
    assert torch.equal(m.generate(ids[:1], max_new_tokens=NEW, do_sample=False, pad_token_id=0), ref[:1])
    assert m.graph_decoder is dec  # kept between calls: a bucket's graph is captured once


@pytest.mark.parametrize("preset", ["gdn", "qwen3next"])
def test_sampling_draws_the_eager_samples(preset):
    """fp64: temperature, top-k and top-p sampling from one seed draws the eager path's tokens (the
    same processors, the same multinomial draws on nearly the same logits), with num_return_sequences."""
    m = tiny(preset, torch.float64)
    ids, mask = batch(B=2, T=5, seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=True, temperature=0.7, top_k=40, top_p=0.9,
              num_return_sequences=2, pad_token_id=0)
    torch.manual_seed(11)
    ref = m.generate(ids, **kw)
    torch.manual_seed(11)
    out = m.generate(ids, cache_implementation="static", **kw)
    assert out.shape == (4, 5 + NEW) and torch.equal(out, ref)
    torch.manual_seed(12)
    assert not torch.equal(m.generate(ids, cache_implementation="static", **kw), out)  # it does sample


def test_scores_logits_processors_and_lengths():
    """return_dict_in_generate with output_scores and output_logits: the same sequences, the scores and
    raw logits of every step within fp32 tolerance; repetition_penalty, min_new_tokens (eos suppressed)
    and max_length in place of max_new_tokens are honoured the same way."""
    m = tiny("gdn-h2")
    ids, mask = batch(B=3, T=6, seed=5)
    greedy = m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    eos = int(greedy[1, 6])  # row 1's first token: stops it at once unless min_new_tokens holds it back
    kw = dict(attention_mask=mask, max_length=6 + NEW, do_sample=False, pad_token_id=0, eos_token_id=eos,
              repetition_penalty=1.3, min_new_tokens=4, return_dict_in_generate=True, output_scores=True,
              output_logits=True)
    ref, out = both(m, ids, **kw)
    assert torch.equal(out.sequences, ref.sequences) and out.sequences.shape[1] == 6 + NEW
    assert len(out.scores) == len(ref.scores) == NEW and len(out.logits) == NEW
    for a, b in zip(out.scores + out.logits, ref.scores + ref.logits):
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a))
        torch.testing.assert_close(a[finite], b[finite], rtol=1e-5, atol=1e-5)
    assert (out.scores[0][:, eos] == float("-inf")).all()  # min_new_tokens masks eos in the first steps
    assert torch.equal(out.logits[0], ref.logits[0])  # the first step's logits come from the same prefill


class Recorder:
    """A transformers streamer: keeps every put (the prompt first, then one [B] tensor per token)."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


def test_streamer_gets_every_token():
    m = tiny("gdn")
    ids = torch.randint(1, 256, (1, 5), generator=torch.Generator().manual_seed(6))
    outs = []
    for impl in (None, "static"):
        rec = Recorder()
        seq = m.generate(ids, max_new_tokens=NEW, do_sample=False, streamer=rec, cache_implementation=impl)
        assert rec.ended and torch.equal(rec.puts[0], ids)
        assert torch.cat([p.reshape(1, -1) for p in rec.puts[1:]], 1).tolist() == seq[:, 5:].tolist()
        outs.append((seq, [p.tolist() for p in rec.puts]))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]


@pytest.mark.parametrize("kwargs,name", [
    (dict(num_beams=2), "beam"),
    (dict(return_dict_in_generate=True, output_hidden_states=True), "output_hidden_states"),
    (dict(use_cache=False), "use_cache"),
    (dict(prompt_lookup_num_tokens=3), "assisted"),
])
def test_unsupported_options_fall_back_with_one_warning(kwargs, name):
    """An option the graph loop cannot honour: one warning naming it, and the eager result (one row:
    transformers' assisted decoding takes one sequence)."""
    m = tiny("gdn-h1")
    ids = torch.randint(1, 256, (1, 5), generator=torch.Generator().manual_seed(7))
    ref = m.generate(ids, max_new_tokens=4, do_sample=False, **kwargs)
    with pytest.warns(UserWarning, match=name) as caught:
        out = m.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static", **kwargs)
    assert len([w for w in caught if "cache_implementation='static'" in str(w.message)]) == 1
    ref_ids = ref.sequences if hasattr(ref, "sequences") else ref
    out_ids = out.sequences if hasattr(out, "sequences") else out
    assert torch.equal(out_ids, ref_ids)
    assert m.graph_decoder is None


def test_inputs_embeds_fall_back():
    m = tiny("gdn")
    ids = torch.randint(1, 256, (1, 5), generator=torch.Generator().manual_seed(8))
    emb = m.get_input_embeddings()(ids)
    ref = m.generate(inputs_embeds=emb, max_new_tokens=4, do_sample=False)
    with pytest.warns(UserWarning, match="inputs_embeds"):
        out = m.generate(inputs_embeds=emb, max_new_tokens=4, do_sample=False, cache_implementation="static")
    assert torch.equal(out, ref)


def test_decoder_kept_replaced_and_grown():
    """The model's decoder is reused across calls; a batch above the largest bucket gets its own
    bucket; a global attention bucket is rebuilt longer when a call needs more slots (max_cache_len
    sizes it ahead) and kept when it holds enough; other batch sizes get buffers of their own call's
    length; a dtype change or a deep copy never reuses captured state."""
    m = tiny("transformer")
    m.generation_config.cache_implementation = "static"
    ids = torch.randint(1, 256, (70, 4), generator=torch.Generator().manual_seed(9))
    ref = m.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation=None)
    assert torch.equal(m.generate(ids, max_new_tokens=3, do_sample=False), ref)
    dec = m.graph_decoder
    assert dec.buckets[-1] == 70 and dec.static_cache.max_length == 7

    def length(**kw):
        m.generate(ids[:2], do_sample=False, **kw)
        assert m.graph_decoder is dec
        return dec.static_cache.max_length

    assert length(max_new_tokens=3) == 7
    assert length(max_new_tokens=6) == 10                      # rebuilt longer
    assert length(max_new_tokens=3) == 10                      # long enough: kept
    assert length(max_new_tokens=3, max_cache_len=9) == 10
    assert length(max_new_tokens=8, max_cache_len=64) == 64    # sized ahead
    assert length(max_new_tokens=20) == 64
    m.generate(ids[:20], max_new_tokens=3, do_sample=False)
    assert dec.static_cache.batch_size == 32 and dec.static_cache.max_length == 7  # its own call's length
    m.to(torch.float64)
    ref64 = m.generate(ids[:2], max_new_tokens=3, do_sample=False, cache_implementation=None)
    assert torch.equal(m.generate(ids[:2], max_new_tokens=3, do_sample=False), ref64)
    assert m.graph_decoder is not dec
    assert copy.deepcopy(m).graph_decoder is None


def test_graph_decoder_property():
    m = tiny("gdn")
    other = tiny("gdn")
    mine = GraphDecoder(m, max_length=32, buckets=(2,))
    m.graph_decoder = mine
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(10))
    ref = m.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static"), ref)
    assert m.graph_decoder is mine and mine.static_cache.batch_size == 2
    with pytest.raises(ValueError, match="graph_decoder"):
        m.graph_decoder = GraphDecoder(other, max_length=8)
    with pytest.raises(ValueError, match="graph_decoder"):
        m.graph_decoder = "yes"
    m.graph_decoder = None
    assert m.graph_decoder is None


def test_early_stop_and_one_token():
    """Every row ending on its first token, or max_new_tokens=1: the eager result, and no decoder is
    built (nothing was left to decode)."""
    m = tiny("qwen3next")
    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(13))
    first = m.generate(ids, max_new_tokens=1, do_sample=False)
    assert first.shape == (2, 7)
    assert torch.equal(m.generate(ids, max_new_tokens=1, do_sample=False, cache_implementation="static"), first)
    row = ids[:1]
    eos = int(first[0, 6])
    ref, out = both(m, row, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    assert out.shape == (1, 7) and torch.equal(out, ref)
    assert m.graph_decoder is None
