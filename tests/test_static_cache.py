"""The static cache and its in-place decode step (gdn.models.static_cache) against the eager decode
on the GDNCache: same greedy tokens, same logits (fp32 1e-5, fp64 1e-10), buffers never
reallocated, rows padded up to a bucket leave the real rows alone. On the CPU the GraphDecoder runs
the very step a CUDA graph captures (tests/gpu/test_graph_decode.py replays it on a GPU)."""
from __future__ import annotations

import pytest
import torch

from gdn.generation import decode_step, generate, generate_shared, prefill
from gdn.models import GDNConfig, GDNForCausalLM, GraphDecoder, StaticCache, static_decode_step

NEW = 12  # generated tokens: more than the window (4), so the ring buffer wraps
CASES = [("gdn", {}), ("gdn-h1", {"window_size": 4}), ("transformer", {}), ("gdn", {"layer_pattern": "KM"}),
         ("gdn", {"layer_pattern": "GSA", "num_hidden_layers": 3, "window_size": 4})]
IDS = ["gdn", "gdn-h1", "transformer", "KM", "GSA"]
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def tiny(preset, dtype, **kw):
    torch.manual_seed(0)
    kw = {"hidden_size": 32, "num_hidden_layers": 2, "head_dim": 16, "intermediate_size": 64, **kw}
    cfg = GDNConfig.from_preset(preset, "tiny", **kw)
    return GDNForCausalLM(cfg).to(dtype).eval()


def prompt(B, T, vocab, seed=0):
    return torch.randint(1, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def left_mask(B, T):
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(B):
        mask[b, : b % 3] = 0  # rows with 0, 1, 2 padding slots
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("preset,kw", CASES, ids=IDS)
def test_static_decode_equals_eager(preset, kw, dtype):
    """Greedy decode token for token and the logits of every step, on a left-padded batch of 3
    (run in bucket 4: one padded row)."""
    m = tiny(preset, dtype, **kw)
    ids = prompt(3, 7, m.config.vocab_size)
    mask = left_mask(3, 7)
    logits, cache = prefill(m, ids, mask)
    dec = GraphDecoder(m, max_length=7 + NEW)
    dec.start(cache.snapshot())
    assert dec.static_cache.batch_size == 4
    t_eager = t_static = logits.argmax(-1)
    for _ in range(NEW):
        a = decode_step(m, t_eager, cache)
        b = dec.step(t_static)
        assert (a - b).abs().max().item() <= TOL[dtype] * max(1.0, a.abs().max().item())
        t_eager, t_static = a.argmax(-1), b.argmax(-1)
        assert torch.equal(t_eager, t_static)


@pytest.mark.parametrize("preset,kw", CASES, ids=IDS)
def test_step_writes_in_place(preset, kw):
    """The step never reallocates a state buffer: every data_ptr (and the buffer list) is unchanged."""
    m = tiny(preset, torch.float32, **kw)
    _, cache = prefill(m, prompt(2, 5, m.config.vocab_size))
    static = StaticCache(m, 2, 5 + NEW)
    static.load(cache)
    bufs = static.buffers()
    ptrs = [t.data_ptr() for t in bufs]
    tok = torch.tensor([3, 4])
    with torch.no_grad():
        for _ in range(NEW):
            tok = static_decode_step(m, static, tok).argmax(-1)
    assert [t.data_ptr() for t in static.buffers()] == ptrs
    assert all(a is b for a, b in zip(static.buffers(), bufs))
    assert int(static.seen) == 5 + NEW
    assert static.positions.tolist() == [5 + NEW] * 2


@pytest.mark.parametrize("preset,kw", CASES, ids=IDS)
def test_bucket_padding_leaves_real_rows(preset, kw):
    """Rows padded up to a bucket (3 -> 8, garbage in the pad rows' states) do not change the real
    rows: logits equal those of an exact-size static cache."""
    m = tiny(preset, torch.float64, **kw)
    _, cache = prefill(m, prompt(3, 6, m.config.vocab_size, seed=1))
    exact = GraphDecoder(m, max_length=6 + NEW, buckets=(3,))
    padded = GraphDecoder(m, max_length=6 + NEW, buckets=(8,))
    exact.start(cache)
    padded.start(cache)
    with torch.no_grad():  # pad rows start from noise rather than zeros
        for st in padded.static_cache.layers:
            for t in (st.conv + (st.recurrent,)) if hasattr(st, "recurrent") else (st.key, st.value):
                t[3:].normal_()
    tok = torch.tensor([5, 6, 7])
    for _ in range(NEW):
        a, b = exact.step(tok), padded.step(tok)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        tok = a.argmax(-1)


@pytest.mark.parametrize("preset,kw", CASES[:3], ids=IDS[:3])
def test_generate_graph_flag(preset, kw):
    """``generate(..., graph=True)`` and a reused GraphDecoder give the eager greedy tokens; so does
    ``generate_shared`` (rows of different lengths)."""
    m = tiny(preset, torch.float32, **kw)
    ids = prompt(2, 6, m.config.vocab_size, seed=2)
    ref = generate(m, ids, max_new_tokens=NEW)
    assert torch.equal(generate(m, ids, max_new_tokens=NEW, graph=True), ref)
    dec = GraphDecoder(m, max_length=64)
    assert torch.equal(generate(m, ids, max_new_tokens=NEW, graph=dec), ref)
    assert torch.equal(generate(m, ids[:1], max_new_tokens=NEW, graph=dec), ref[:1])
    prompts = [[5, 6, 7, 8], [5, 6, 9], [1, 2, 3, 4, 5, 6, 7]]
    assert generate_shared(m, prompts, max_new_tokens=NEW, graph=True) == generate_shared(m, prompts,
                                                                                           max_new_tokens=NEW)


def test_limits():
    m = tiny("transformer", torch.float32)
    _, cache = prefill(m, prompt(2, 5, m.config.vocab_size))
    dec = GraphDecoder(m, max_length=6, buckets=(1, 2))
    dec.start(cache)
    dec.step(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="full"):
        dec.step(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="shape"):
        dec.step(torch.tensor([1]))
    with pytest.raises(ValueError, match="largest bucket"):
        dec.bucket(3)
    with pytest.raises(ValueError, match="max_length"):
        GraphDecoder(m, max_length=5).start(cache)
    with pytest.raises(ValueError, match="CUDA"):
        GraphDecoder(m, max_length=8, use_graph=True)
    with pytest.raises(TypeError, match="graph"):
        generate(m, prompt(1, 3, m.config.vocab_size), max_new_tokens=2, graph="yes")


def test_reserve():
    """reserve(batch, length): adds a bucket above the largest, rebuilds a global attention bucket
    that holds fewer slots, keeps one that holds more (and any bucket of a model without global
    attention)."""
    m = tiny("transformer", torch.float32)
    dec = GraphDecoder(m, max_length=8, buckets=(1, 2))
    dec.reserve(5, 12)
    assert dec.buckets == [1, 2, 5]
    _, cache = prefill(m, prompt(5, 10, m.config.vocab_size))
    dec.start(cache)
    assert dec.static_cache.batch_size == 5 and dec.static_cache.max_length == 12
    tok = torch.arange(5)
    dec.step(tok)
    dec.step(tok)
    with pytest.raises(ValueError, match="full"):
        dec.step(tok)
    kept = dec.static_cache
    dec.reserve(5, 6)
    dec.start(cache)
    assert dec.static_cache is kept
    dec.reserve(4, 20)
    with pytest.raises(RuntimeError, match="start"):
        dec.step(tok)  # the active bucket was rebuilt: start again
    dec.start(cache)
    assert dec.static_cache is not kept and dec.static_cache.max_length == 20
    with pytest.raises(ValueError, match="max_length"):
        dec.reserve(1, 0)
    g = GraphDecoder(tiny("gdn", torch.float32), max_length=4, buckets=(2,))
    g.reserve(2, 4)
    first = g._buckets[2]
    g.reserve(2, 400)
    assert g._buckets[2] is first


def alone(m, p, steps):
    """Greedy logits of ``p`` decoded alone on the eager cache: the prefill's, then ``steps`` steps'."""
    logits, cache = prefill(m, torch.tensor([p]))
    out = [logits[0]]
    for _ in range(steps):
        out.append(decode_step(m, out[-1].argmax(-1)[None], cache)[0])
    return out


def tokens_of(vocab, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("preset,kw", CASES, ids=IDS)
def test_load_rows_replaces_rows_in_place(preset, kw, dtype):
    """Three rows decode a few steps in bucket 4; two newcomers go into rows 2 and 0 with load_rows:
    rows 1 and 3 stay bit-identical, no buffer moves, and then every row decodes as its prompt alone
    (greedy tokens equal, logits within the tolerance). A newcomer whose global attention keys do
    not fit before the slot counter is refused, and GraphDecoder.refill makes room for it."""
    from gdn.generation import prefill_packed

    m = tiny(preset, dtype, **kw)
    V = m.config.vocab_size
    first, newcomers = tokens_of(V, (7, 3, 5), 1), tokens_of(V, (4, 9), 2)
    logits, cache = prefill_packed(m, first)
    dec = GraphDecoder(m, max_length=40, buckets=(4,))
    dec.start(cache)
    static = dec.static_cache
    ptrs = [t.data_ptr() for t in static.buffers()]
    refs = [alone(m, p, 3 + NEW) for p in first]
    tok = logits.argmax(-1)
    for s in range(3):
        tok = dec.step(tok).argmax(-1)
    before = [t.clone() for t in static.buffers()]
    new_logits, new_cache = prefill_packed(m, newcomers)
    static.load_rows(new_cache, [2, 0])
    for t, b in zip(static.buffers()[:-2], before):
        assert torch.equal(t[[1, 3]], b[[1, 3]])
    assert torch.equal(static.seen, before[-2]) and static.positions.tolist() == [9, 3 + 3, 4, 3]
    assert [t.data_ptr() for t in static.buffers()] == ptrs
    seen = int(static.seen)
    for st in static.layers:  # a newcomer's last key sits at slot seen - 1 (a ring: mod window)
        if hasattr(st, "valid"):
            for r, n in ((2, 4), (0, 9)):
                W = st.window or static.max_length
                want = sorted(s % W for s in range(seen - min(n, W - 1 if st.window else n), seen))
                assert st.valid[r].nonzero().flatten().tolist() == want
    refs = [alone(m, newcomers[1], NEW), refs[1][3:], alone(m, newcomers[0], NEW)]
    tok = torch.stack([new_logits[1].argmax(-1), tok[1], new_logits[0].argmax(-1)])
    for s in range(NEW):
        out = dec.step(tok)
        for r in range(3):
            a = refs[r][s + 1]
            assert (out[r] - a).abs().max().item() <= TOL[dtype] * max(1.0, a.abs().max().item())
        tok = out.argmax(-1)
        assert tok.tolist() == [refs[r][s + 1].argmax(-1).item() for r in range(3)]
    assert [t.data_ptr() for t in static.buffers()] == ptrs

    # a newcomer longer than the slots used so far (3 + 3 + NEW = 18): global layers refuse it
    seen = int(static.seen)
    long = tokens_of(V, (seen + 5,), 3)
    long_logits, long_cache = prefill_packed(m, long)
    if static._has_global():
        with pytest.raises(ValueError, match=f"fills {seen + 5} global attention slots.*shift\\(5\\)"):
            static.load_rows(long_cache, [1])
    dec.refill(long_cache, [1])  # moves every row 5 slots later when it must, then loads
    assert [t.data_ptr() for t in static.buffers()] == ptrs
    ref = alone(m, long[0], NEW)
    tok = torch.stack([tok[0], long_logits[0].argmax(-1), tok[2]])
    for s in range(NEW):
        out = dec.step(tok)
        a = ref[s + 1]
        assert (out[1] - a).abs().max().item() <= TOL[dtype] * max(1.0, a.abs().max().item())
        tok = out.argmax(-1)


@pytest.mark.parametrize("preset,kw", CASES, ids=IDS)
def test_refill_and_release_leave_other_rows(preset, kw):
    """GraphDecoder.refill of one row (a short newcomer into the shortest row: nothing to compact)
    leaves every other row bit-identical; release empties the row and keeps the batch size."""
    from gdn.generation import prefill_packed

    m = tiny(preset, torch.float64, **kw)
    V = m.config.vocab_size
    _, cache = prefill_packed(m, tokens_of(V, (8, 2, 6), 4))
    dec = GraphDecoder(m, max_length=30, buckets=(3,))
    dec.start(cache)
    tok = torch.tensor([1, 2, 3])
    for _ in range(2):
        dec.step(tok)
    static = dec.static_cache
    before = [t.clone() for t in static.buffers()]
    _, new_cache = prefill_packed(m, tokens_of(V, (2,), 5))
    dec.refill(new_cache, [1])
    for t, b in zip(static.buffers(), before):
        assert torch.equal(t[[0, 2]], b[[0, 2]]) if t.dim() else torch.equal(t, b)
    dec.release([1])
    assert static.batch_size == 3 and dec.rows == 3 and dec.free == {1}
    assert static.positions[1].item() == 0
    for st in static.layers:
        if hasattr(st, "valid"):
            assert not st.valid[1].any()
    dec.step(tok)
    with pytest.raises(ValueError, match="distinct rows"):
        dec.refill(new_cache, [3])


def test_shift_and_compact():
    """shift moves every row's keys (a window ring rotates) and the slot counter; compact drops the
    leading slots no row attends; both refuse what does not fit."""
    m = tiny("gdn", torch.float64, layer_pattern="GSA", num_hidden_layers=3, window_size=4)
    _, cache = prefill(m, prompt(2, 6, m.config.vocab_size))
    static = StaticCache(m, 2, 12)
    static.load(cache)
    g, w = static.layers[2], static.layers[1]
    key, ring = g.key.clone(), w.key.clone()
    static.shift(3)
    assert int(static.seen) == 9 and static.length == 9
    assert torch.equal(g.key[:, 3:9], key[:, :6]) and not g.valid[:, :3].any() and g.valid[:, 3:9].all()
    assert torch.equal(w.key, ring.roll(3, 1))
    assert static.compact() == 3 and int(static.seen) == 6
    assert torch.equal(g.key, key) and torch.equal(w.key, ring)
    with pytest.raises(ValueError, match="max_length > 12"):
        static.shift(6)
    with pytest.raises(ValueError, match="earlier"):
        static.shift(-7)
    static.seen.fill_(12)
    with pytest.raises(ValueError, match="no room"):
        static.load_rows(cache.snapshot([0]), [1])
