"""Packed prefill (one row, cu_seqlens, per-prompt cache rows) and decoding slots refilled as
sequences finish: both equal generating every prompt alone."""
from __future__ import annotations

import pytest
import torch

from gdn import generation as G
from gdn.layers.state import KVState
from gdn.models import GDNConfig, GDNForCausalLM

TINY = dict(hidden_size=32, vocab_size=256)
CASES = {"gdn": {}, "gdn-h1": {"window_size": 8},  # the window is shorter than some prompts
         "transformer": {}, "KMSA": {"layer_pattern": "KMSA", "num_hidden_layers": 4, "window_size": 8}}


def tiny(case, dtype):
    torch.manual_seed(0)
    preset = "gdn" if case == "KMSA" else case
    return GDNForCausalLM(GDNConfig.from_preset(preset, "tiny", **TINY, **CASES[case])).to(dtype).eval()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("case", list(CASES))
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


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_slots_refilled_as_sequences_finish_equal_each_alone(case, dtype, monkeypatch):
    m = tiny(case, dtype)
    lengths = (5, 1, 130, 40, 5, 17, 3, 60, 1, 9)
    prompts = prompts_of(lengths, seed=1)
    limits = [3, 9, 1, 12, 6, 0, 8, 2, 11, 5]
    alone = [G.generate(m, torch.tensor([p]), max_new_tokens=12)[0, len(p):].tolist() for p in prompts]
    eos = alone[3][4]
    expected = []
    for a, n in zip(alone, limits):
        a = a[:n]
        expected.append(a[:a.index(eos) + 1] if eos in a else a)
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
