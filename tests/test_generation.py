"""gdn.generation: prefill + recurrent decode equals generate() and the full forward; streaming;
sampling controls."""
from __future__ import annotations

import pytest
import torch

from gdn import generation as G
from gdn.models import GDNCache, GDNConfig, GDNForCausalLM, output_cache

V = 61


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GDNForCausalLM(GDNConfig.from_preset("gdn-h1", hidden_size=64, vocab_size=V, window_size=6)).eval()


def prompt(B=2, T=8, seed=0):
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_greedy_matches_generate_and_full_forward(model):
    x = prompt()
    ours = G.generate(model, x, max_new_tokens=9)
    hf = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=9, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, hf)
    with torch.no_grad():
        logits = model(ours[:, :-1]).logits
    assert torch.equal(logits[:, 7:].argmax(-1), ours[:, 8:])


def test_prefill_and_decode_step_equal_forward(model):
    x = prompt(T=12)
    logits, cache = G.prefill(model, x[:, :10])
    with torch.no_grad():
        full = model(x).logits
    assert torch.allclose(logits, full[:, 9], rtol=1e-5, atol=1e-5)
    nxt = G.decode_step(model, x[:, 10], cache)
    assert torch.allclose(nxt, full[:, 10], rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 11
    with pytest.raises(ValueError, match="tokens"):
        G.decode_step(model, x[:1, 0], cache)


def test_streaming_yields_tokens_one_step_at_a_time(model):
    x = prompt(B=1)
    seen = []
    out = G.generate(model, x, max_new_tokens=5, callback=lambda step, tok: seen.append((step, tok.tolist())))
    assert [s for s, _ in seen] == list(range(5))
    assert [t[0] for _, t in seen] == out[0, 8:].tolist()
    it = G.stream(model, x, max_new_tokens=3)
    first = next(it)
    assert first.shape == (1,) and first.item() == out[0, 8].item()


def test_left_padded_batch_equals_each_alone(model):
    a, b = prompt(1, 9, seed=1), prompt(1, 3, seed=2)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 6, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :6] = 0
    g = G.generate(model, batch, attention_mask=mask, max_new_tokens=6)
    assert torch.equal(g[0], G.generate(model, a, max_new_tokens=6)[0])
    assert torch.equal(g[1, 6:], G.generate(model, b, max_new_tokens=6)[0])


def test_sampling_reproducible_and_eos_stops(model):
    x = prompt()
    run = [G.generate(model, x, max_new_tokens=8, temperature=1.0, top_k=10, top_p=0.9,
                      generator=torch.Generator().manual_seed(s)) for s in (5, 5, 6)]
    assert torch.equal(run[0], run[1]) and not torch.equal(run[0], run[2])
    greedy = G.generate(model, x[:1], max_new_tokens=8)
    eos = greedy[0, 10].item()
    stopped = G.generate(model, x[:1], max_new_tokens=8, eos_token_id=eos)
    first_eos = (greedy[0, 8:] == eos).nonzero()[0].item()
    assert stopped.shape[1] == 8 + first_eos + 1 and stopped[0, -1].item() == eos


def test_sample_next_filters():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]])
    assert G.sample_next(logits).tolist() == [1]
    g = torch.Generator().manual_seed(0)
    draws = {G.sample_next(logits, temperature=1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert draws == {1, 2}
    draws = {G.sample_next(logits, temperature=1.0, top_p=0.3, generator=g).item() for _ in range(100)}
    assert draws == {1}
    for bad in (dict(temperature=-1), dict(temperature=1.0, top_k=0), dict(temperature=1.0, top_p=0.0)):
        with pytest.raises(ValueError):
            G.sample_next(logits, **bad)


def test_zero_new_tokens_and_bad_prompt(model):
    x = prompt()
    assert torch.equal(G.generate(model, x, max_new_tokens=0), x)
    with pytest.raises(ValueError, match="max_new_tokens"):
        G.generate(model, x, max_new_tokens=-1)
    with pytest.raises(ValueError, match="input_ids"):
        G.prefill(model, x[0])


def test_generation_benchmark_runs_on_cpu(tmp_path, capsys, monkeypatch):
    """benchmarks/generation.py on the CPU with tiny models: every model row is measured or says why
    not (FLA needs CUDA; the prefill and KV budgets skip what they should), the table prints and the
    JSON holds the rows."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "generation.py"
    spec = importlib.util.spec_from_file_location("bench_generation", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclass looks its module up
    spec.loader.exec_module(bench)
    out_json = tmp_path / "gen.json"
    rows = bench.main(["--size", "tiny", "--device", "cpu", "--batches", "1,2", "--prompts", "8,12",
                       "--new-tokens", "2", "--max-prefill-tokens", "16", "--kv-budget-gib", "5.7e-5",
                       "--json", str(out_json)])
    by = {(r["model"], r["batch"], r["prompt"]): r for r in rows}
    assert len(rows) == 5 * 4
    for name in ("gdn-graph", "gdn-eager", "transformer-graph", "llama"):
        r = by[(name, 1, 8)]
        assert "note" not in r and r["ttft_ms"] > 0 and r["new_tok_s"] > 0, r
        assert "max-prefill-tokens" in by[(name, 2, 12)]["note"]  # 24 tokens > 16
    # KV of 2 rows × (8 + 2) tokens: llama 2 × 10 × 4 layers × 2 × 2 heads × 32 × 4 B = 40 KiB, below
    # the budget (5.7e-5 GiB ≈ 60 KiB); the graph path holds two copies (80 KiB): above
    assert "note" not in by[("llama", 2, 8)]
    assert "KV cache" in by[("transformer-graph", 2, 8)]["note"] and "note" not in by[("gdn-graph", 2, 8)]
    assert all("CUDA" in by[("fla", b, t)]["note"] for b in (1, 2) for t in (8, 12))
    out = capsys.readouterr().out
    assert "| model | batch | prompt | TTFT ms | new tok/s | peak GiB | note |" in out
    assert "| gdn-graph | 1 | 8 |" in out
    saved = json.loads(out_json.read_text())
    assert saved["rows"] == rows and saved["meta"]["new_tokens"] == 2


# --- prefix caches, shared prefixes, speculative decoding ----------------------------------------

TINY = dict(hidden_size=32, num_hidden_layers=2, head_dim=16, intermediate_size=64)


def tiny(preset, seed=0, dtype=torch.float32):
    """A tiny random model (vocab 256); gdn-h1 with a window of 8, which decoding overruns."""
    torch.manual_seed(seed)
    extra = {"window_size": 8} if preset == "gdn-h1" else {}
    return GDNForCausalLM(GDNConfig.from_preset(preset, "tiny", **TINY, **extra)).to(dtype).eval()


def state_tensors(cache):
    out = []
    for s in cache.layers:
        out += [*s.conv, s.recurrent] if hasattr(s, "recurrent") else [s.key, s.value]
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_prefill_snapshots_equal_prefilling_each_prefix_alone(dtype, tol):
    """The first snapshot is the very same call (bit for bit); later ones continue the cache in
    chunked segments and agree within the chunk form's tolerance (docs/DESIGN.md §6, tier 2)."""
    m = tiny("gdn-h1", dtype=dtype)
    x = torch.randint(1, 256, (2, 70), generator=torch.Generator().manual_seed(0))
    logits, cache, snaps = G.prefill_snapshots(m, x, [5, 17, 66])
    assert [s.seen for s in snaps] == [5, 17, 66] and cache.seen == 70
    for o, snap in zip([5, 17, 66], snaps):
        _, ref = G.prefill(m, x[:, :o])
        assert torch.equal(snap.positions, ref.positions)
        errs = [((a - b).norm() / b.norm()).item() for a, b in zip(state_tensors(snap), state_tensors(ref))]
        if o == 5:
            assert max(errs) == 0.0
        else:
            assert 0 < max(errs) < tol
    full, _ = G.prefill(m, x)
    assert ((logits - full).norm() / full.norm()).item() < tol
    # a snapshot is a copy: continuing the returned cache leaves it as it was
    G.decode_step(m, x[:, 0], cache)
    assert snaps[-1].seen == 66
    for bad in ([0], [5, 5], [71], []):
        with pytest.raises(ValueError, match="snapshot_at"):
            G.prefill_snapshots(m, x, bad)


@pytest.mark.parametrize("preset", ["gdn", "gdn-h1"])
def test_shared_prefixes_prefilled_once_and_greedy_equals_each_alone(preset):
    m = tiny(preset)
    base = torch.randint(1, 256, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = [base[:15] + [3, 4, 5], base[:15] + [3, 9], base[:12], base[:15] + [3, 4, 5], [7, 8], base]
    # the prefix tree's edges, each prefilled once: base[:12]; base[12:15]; [3]; [4, 5] (twice asked);
    # [9]; base[15:]; [7, 8] -- 30 of the 91 prompt tokens
    _, cache, computed = G.prefill_shared(m, prompts)
    assert computed == 12 + 3 + 1 + 2 + 1 + 9 + 2
    assert cache.batch_size == 6 and cache.positions.tolist() == [len(p) for p in prompts]
    outs = G.generate_shared(m, prompts, max_new_tokens=10)
    alone = [G.generate(m, torch.tensor([p]), max_new_tokens=10)[0, len(p):].tolist() for p in prompts]
    assert outs == alone and outs[0] == outs[3]
    eos = alone[1][3]
    stopped = G.generate_shared(m, prompts, max_new_tokens=10, eos_token_id=eos)
    assert stopped[1] == alone[1][:alone[1].index(eos) + 1]
    with pytest.raises(ValueError, match="non-empty"):
        G.prefill_shared(m, [[1, 2], []])


@pytest.fixture
def crops(monkeypatch):
    """Counts the slots the caches give back, so a test knows that rejected drafts were rolled back."""
    removed = []
    crop = GDNCache.crop

    def counting(self, max_length):
        removed.append(max(0, -int(max_length)))
        return crop(self, max_length)

    monkeypatch.setattr(GDNCache, "crop", counting)
    return removed


@pytest.mark.parametrize("preset", ["gdn", "gdn-h1"])
def test_assisted_and_prompt_lookup_decoding_equal_greedy(preset, crops):
    """transformers' assisted generation (a tiny gdn assistant: the model's weights plus noise, so
    drafts are partly accepted; an unrelated model, mostly rejected) and prompt-lookup decoding give
    the greedy tokens; the main model's cache is cut back after every rejected draft."""
    m = tiny(preset, dtype=torch.float64)
    near = tiny(preset, dtype=torch.float64)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    other = tiny(preset, seed=1, dtype=torch.float64)
    x = torch.randint(1, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    x = torch.cat([x, x[:, :6]], 1)  # a repeated n-gram, for prompt lookup
    kw = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
    greedy = m.generate(x, **kw)
    assert torch.equal(greedy, G.generate(m, x, max_new_tokens=30))
    for extra in (dict(assistant_model=near), dict(assistant_model=other), dict(prompt_lookup_num_tokens=3)):
        crops.clear()
        assert torch.equal(m.generate(x, **kw, **extra), greedy), extra
        assert sum(crops) > 0, extra
    out = m.generate(x, **kw, assistant_model=near, return_dict_in_generate=True)
    cache = output_cache(out)
    assert cache.recording and cache.seen == greedy.shape[1] - 1


def test_assisted_decoding_in_fp32():
    m, a = tiny("gdn-h1"), tiny("gdn-h1", seed=1)
    x = torch.randint(1, 256, (1, 10), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(m.generate(x, **kw, assistant_model=a), m.generate(x, **kw))


def test_cli_generate_several_prompts_equals_one_by_one(tmp_path, capsys):
    from gdn.cli import main

    tiny("gdn-h1").save_pretrained(tmp_path / "ckpt")
    prompts = ["def add(a, b):", "def add(a, c):", "def sub(a, b):"]
    (tmp_path / "prompts.txt").write_text(prompts[1] + "\n\n" + prompts[2] + "\n")
    args = ["generate", "--ckpt", str(tmp_path / "ckpt"), "--temperature", "0", "--max-new-tokens", "8",
            "--device", "cpu"]
    singles = []
    for p in prompts:
        assert main(args + ["--prompt", p]) == 0
        singles.append(capsys.readouterr().out)
    assert main(args + ["--prompt", prompts[0], "--prompts-file", str(tmp_path / "prompts.txt")]) == 0
    assert capsys.readouterr().out == "---\n".join(singles)
    assert main(args + ["--prompts-file", str(tmp_path / "missing.txt")]) == 2
    assert "prompts-file" in capsys.readouterr().err


def test_cli_generate_graph_equals_eager(tmp_path, capsys):
    """``gdn generate --graph`` (the static-cache step, run eagerly on the CPU) prints what the
    eager decode prints, for one prompt, for several, and for more prompts than slots (rows refilled)."""
    from gdn.cli import main

    tiny("gdn-h1").save_pretrained(tmp_path / "ckpt")
    args = ["generate", "--ckpt", str(tmp_path / "ckpt"), "--temperature", "0", "--max-new-tokens", "10",
            "--device", "cpu", "--prompt", "def add(a, b):"]
    for extra in ([], ["--prompt", "import os"]):
        assert main(args + extra) == 0
        eager = capsys.readouterr().out
        assert main(args + extra + ["--graph"]) == 0
        assert capsys.readouterr().out == eager
    more = args + ["--prompt", "x", "--prompt", "a longer prompt", "--batch-size", "2"]
    assert main(more) == 0
    eager = capsys.readouterr().out
    assert main(more + ["--graph"]) == 0
    assert capsys.readouterr().out == eager and eager.count("---") == 2
