"""gdn.generation: prefill + recurrent decode equals generate() and the full forward; streaming;
sampling controls."""
from __future__ import annotations

import pytest
import torch

from gdn import generation as G
from gdn.models import GDNConfig, GDNForCausalLM

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


def test_generation_benchmark_runs_on_cpu(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "generation.py"
    spec = importlib.util.spec_from_file_location("bench_generation", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--size", "tiny", "--presets", "gdn,transformer", "--contexts", "16,48", "--decode-tokens", "2",
                "--check", "20", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "| gdn | G (gated_deltanet) |" in out and "| transformer | A (attention) |" in out
    rows = [line for line in out.splitlines() if line.startswith("| gdn | G")]
    sizes = rows[0].split("|")[3:5]
    assert sizes[0] == sizes[1]  # the recurrent state does not grow with the context
    errs = [float(line.split("|")[3]) for line in out.splitlines() if line.startswith(("| gdn | 20", "| transformer | 20"))]
    assert len(errs) == 2 and max(errs) < 1e-4
