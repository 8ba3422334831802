"""Packed prefill (one row, cu_seqlens, per-prompt cache rows) and decoding slots refilled as
sequences finish: both equal generating every prompt alone."""
from __future__ import annotations

import pytest
import torch

from gdn import generation as G
from gdn.layers.state import KVState
from gdn.models import GDNConfig, GDNForCausalLM, GraphDecoder

TINY = dict(hidden_size=32, vocab_size=256)
CASES = {"gdn": {}, "gdn-h1": {"window_size": 8},  # the window is shorter than some prompts
         "transformer": {}, "KMSA": {"layer_pattern": "KMSA", "num_hidden_layers": 4, "window_size": 8},
         "KM": {"layer_pattern": "KM", "num_hidden_layers": 2}}


def tiny(case, dtype):
    torch.manual_seed(0)
    preset = "gdn" if case.startswith("KM") else case
    return GDNForCausalLM(GDNConfig.from_preset(preset, "tiny", **TINY, **CASES[case])).to(dtype).eval()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in lengths]


def until_eos(alone, limits, eos):
    """Each prompt's tokens alone cut to its limit and after its first ``eos``: what the slots must give."""
    out = []
    for a, n in zip(alone, limits):
        a = a[:n]
        out.append(a[:a.index(eos) + 1] if eos in a else a)
    return out


@pytest.mark.parametrize("case", ["gdn", "gdn-h1", "transformer", "KMSA"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_prefill_equals_each_prompt_alone(case, dtype):
    m = tiny(case, dtype)
    prompts = prompts_of((5, 1, 130, 40, 5))
    logits, cache = G.prefill_packed(m, prompts)
    assert cache.batch_size == 5 and cache.positions.tolist() == [len(p) for p in prompts]
    assert cache.seen == 130
    steps, tok, batch = 6, logits.argmax(-1), [logits]
    toks = [tok]
    for _ in range(steps):
        batch.append(G.decode_step(m, tok, cache))
        tok = batch[-1].argmax(-1)
        toks.append(tok)
    toks = torch.stack(toks, 1)
    for i, p in enumerate(prompts):
        l1, c1 = G.prefill(m, torch.tensor([p]))
        alone, t = [l1], l1.argmax(-1)
        for _ in range(steps):
            alone.append(G.decode_step(m, t, c1))
            t = alone[-1].argmax(-1)
        assert toks[i].tolist() == G.generate(m, torch.tensor([p]), max_new_tokens=steps + 1)[0, len(p):].tolist()
        if dtype == torch.float64:
            for a, b in zip(alone, batch):
                torch.testing.assert_close(b[i], a[0], rtol=1e-10, atol=1e-10)


def test_packed_prefill_rejects_empty_prompts():
    m = tiny("gdn", torch.float32)
    for bad in ([], [[1, 2], []]):
        with pytest.raises(ValueError, match="non-empty"):
            G.prefill_packed(m, bad)


@pytest.mark.parametrize("case", ["gdn", "gdn-h1", "transformer", "KMSA"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_slots_refilled_as_sequences_finish_equal_each_alone(case, dtype, monkeypatch):
    m = tiny(case, dtype)
    lengths = (5, 1, 130, 40, 5, 17, 3, 60, 1, 9)
    prompts = prompts_of(lengths, seed=1)
    limits = [3, 9, 1, 12, 6, 0, 8, 2, 11, 5]
    alone = [G.generate(m, torch.tensor([p]), max_new_tokens=12)[0, len(p):].tolist() for p in prompts]
    eos = alone[3][4]
    expected = until_eos(alone, limits, eos)
    assert any(eos in e for e in expected)
    sizes, seen = [], []
    step = G.decode_step

    def watching(model, tokens, cache):
        sizes.append(cache.batch_size)
        seen.append(max((s.key.shape[1] for s in cache.layers if isinstance(s, KVState) and s.window is None),
                        default=0))
        return step(model, tokens, cache)

    monkeypatch.setattr(G, "decode_step", watching)
    order = []
    outs = G.generate_slots(m, prompts, max_new_tokens=limits, batch_size=3, eos_token_id=eos,
                            callback=lambda i, new: order.append(i))
    assert outs == expected
    assert sorted(order) == list(range(len(prompts))) and order != sorted(order)
    assert max(sizes) == 3 and sizes[0] == 3
    # global attention slots nobody attends to any more are dropped: the keys never outgrow a prompt plus its tokens
    assert max(seen) <= max(lengths) + max(limits)
    assert G.generate_slots(m, prompts[:4], max_new_tokens=5, batch_size=8) == [a[:5] for a in alone[:4]]
    with pytest.raises(ValueError, match="batch_size"):
        G.generate_slots(m, prompts, max_new_tokens=2, batch_size=0)
    with pytest.raises(ValueError, match="limits"):
        G.generate_slots(m, prompts, max_new_tokens=[1, 2], batch_size=2)


@pytest.mark.parametrize("case", ["gdn", "gdn-h1", "transformer", "KM"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lengths", [(5, 1, 130, 40, 5, 17, 3, 60, 1, 9), (3, 2, 4, 50, 1, 70, 6, 2),
                                     (2, 4, 1, 3, 4, 2, 1, 3, 3, 2, 4, 1, 2, 3, 1, 4)],
                         ids=["long-first", "long-later", "many-short"])
def test_slots_on_the_graph_decoder_equal_eager_and_each_alone(case, dtype, lengths, monkeypatch):
    """stream_slots with graph=True / a reused GraphDecoder: the tokens of the eager slots and of each
    prompt alone (greedy, per-prompt limits, an eos that ends rows early, more prompts than slots;
    "long-later": prompts longer than every live row arrive as newcomers, so global attention rows
    move later; "many-short": a run of many more steps than one prompt plus its tokens). The batch
    keeps its size (one bucket, one graph) and the global attention slots in use never exceed one
    prompt plus its tokens."""
    m = tiny(case, dtype)
    prompts = prompts_of(lengths, seed=2)
    limits = [(3, 9, 1, 12, 6, 0, 8, 2, 11, 5)[i % 10] for i in range(len(prompts))]
    alone = [G.generate(m, torch.tensor([p]), max_new_tokens=12)[0, len(p):].tolist() for p in prompts]
    eos = alone[3][2]
    expected = until_eos(alone, limits, eos)
    assert any(eos in e and len(e) < n for e, n in zip(expected, limits))  # the eos ends a row early
    eager = G.generate_slots(m, prompts, max_new_tokens=limits, batch_size=3, eos_token_id=eos)
    assert eager == expected
    steps = []
    step = GraphDecoder.step

    def watching(self, tokens):
        steps.append((self.static_cache.batch_size, self.static_cache.length, self.static_cache.max_length))
        return step(self, tokens)

    monkeypatch.setattr(GraphDecoder, "step", watching)
    assert G.generate_slots(m, prompts, max_new_tokens=limits, batch_size=3, eos_token_id=eos, graph=True) == expected
    assert {s[0] for s in steps} == {4}  # 3 rows in bucket 4 from start to end
    budget = max(len(p) + n for p, n in zip(prompts, limits) if n)
    if case == "transformer":  # global attention: compaction bounds the slots in use
        assert all(s[1] < budget for s in steps) and steps[0][2] == budget
    dec = GraphDecoder(m, max_length=8, buckets=(2, 4))
    got = list(G.stream_slots(m, prompts, max_new_tokens=limits, batch_size=4, eos_token_id=eos, graph=dec))
    assert sorted(i for i, _ in got) == list(range(len(prompts))) and all(new == expected[i] for i, new in got)
    assert G.generate_slots(m, prompts[:2], max_new_tokens=4, batch_size=2, graph=dec) == [a[:4] for a in alone[:2]]
    with pytest.raises(TypeError, match="graph"):
        G.generate_slots(m, prompts, max_new_tokens=2, batch_size=2, graph="yes")


def test_cli_generate_more_prompts_than_slots_equals_one_by_one(tmp_path, capsys):
    from gdn.cli import main

    tiny("gdn-h1", torch.float32).save_pretrained(tmp_path / "ckpt")
    prompts = ["def add(a, b):", "x", "import torch as t, numpy as np  # a longer line", "def sub(a, b):", "hi"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts[1:]) + "\n")
    args = ["generate", "--ckpt", str(tmp_path / "ckpt"), "--temperature", "0", "--max-new-tokens", "8",
            "--device", "cpu"]
    singles = []
    for p in prompts:
        assert main(args + ["--prompt", p]) == 0
        singles.append(capsys.readouterr().out)
    assert main(args + ["--batch-size", "2", "--prompt", prompts[0], "--prompts-file",
                        str(tmp_path / "prompts.txt")]) == 0
    assert capsys.readouterr().out == "---\n".join(singles)
