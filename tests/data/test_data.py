"""Corpora, the fixed held-out split, packing with cu_seqlens, tokenizers and the MQAR generator."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from gdn.data import (ByteTokenizer, PackedWindows, TokenCorpus, eval_batches, held_out, load_corpus, load_tokenizer,
                      mqar_batch, stdlib_root, train_bpe, unigram_bits_per_byte)


def _docs(tmp_path, n=20):
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(n):
        (d / f"f{i:02d}.txt").write_text(f"document {i} " * (5 + 3 * i))
    (d / "blob.bin").write_bytes(b"\0\1\2" * 10)  # binary: skipped
    return d


def test_held_out_is_a_fixed_fraction():
    keys = [f"pkg/mod{i}.py" for i in range(4000)]
    picked = [k for k in keys if held_out(k, 0.1)]
    assert 300 < len(picked) < 500
    assert picked == [k for k in keys if held_out(k, 0.1)]  # deterministic


def test_folder_split_is_by_document_and_disjoint(tmp_path):
    d = _docs(tmp_path)
    tok = ByteTokenizer()
    train, val = load_corpus(str(d), tok, val_fraction=0.3)
    texts = {p.name: p.read_text() for p in d.glob("*.txt")}
    want_val = "".join(texts[k] for k in sorted(texts) if held_out(k, 0.3))
    want_train = "".join(texts[k] for k in sorted(texts) if not held_out(k, 0.3))
    assert bytes(val.tokens).decode() == want_val and bytes(train.tokens).decode() == want_train
    assert len(train.doc_starts) + len(val.doc_starts) == 20
    assert train.num_bytes == len(want_train.encode())


def test_stdlib_default_split_is_fixed():
    train, val = load_corpus(None, ByteTokenizer())
    n_files = sum(1 for p in stdlib_root().rglob("*.py") if "site-packages" not in p.parts)
    assert len(train.doc_starts) + len(val.doc_starts) <= n_files
    assert len(train) > 5_000_000 and 0.005 < len(val) / len(train) < 0.06
    assert unigram_bits_per_byte(train, val, 256) > 4.0


def test_jsonl_bin_and_single_file(tmp_path):
    tok = ByteTokenizer()
    j = tmp_path / "d.jsonl"
    j.write_text("\n".join(json.dumps({"body": f"text number {i} " * 4}) for i in range(50)))
    train, val = load_corpus(str(j), tok, text_field="body", val_fraction=0.2)
    assert len(train.doc_starts) + len(val.doc_starts) == 50
    with pytest.raises(ValueError, match="text_field|'text'"):
        load_corpus(str(j), tok)
    ids = np.arange(1000, dtype=np.uint16) % 50
    ids[ids == 0] = 7
    ids[[99, 499]] = 0  # eos
    (tmp_path / "train.bin").write_bytes(ids.tobytes())
    (tmp_path / "val.bin").write_bytes(ids[:300].tobytes())
    train, val = load_corpus(str(tmp_path / "train.bin"), tok, eos_id=0)
    assert len(train) == 1000 and list(train.doc_starts) == [0, 100, 500] and len(val) == 300
    single = tmp_path / "one.txt"
    single.write_text("x" * 1000)
    train, val = load_corpus(str(single), tok, val_fraction=0.1)
    assert (len(train), len(val)) == (900, 100)
    with pytest.raises(ValueError, match="neither"):
        load_corpus(str(tmp_path / "missing"), tok)


def test_hf_local_files(tmp_path):
    pytest.importorskip("datasets")
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"record {i} " * 3}) for i in range(40)))
    train, val = load_corpus(f"hf:{p}", ByteTokenizer(), val_fraction=0.25)
    assert len(train.doc_starts) + len(val.doc_starts) == 40 and len(val.doc_starts) > 0


def test_packing_cuts_at_document_and_window_boundaries():
    tokens = np.arange(100, dtype=np.int64) % 256
    corpus = TokenCorpus(tokens, np.array([0, 7, 30, 31, 64]), np.ones(256, np.int64))
    w = PackedWindows(corpus, seq_len=16, seed=3)
    ids, cu = w.pack(range(6))
    starts = [w.window_start(s) for s in range(6)]
    assert sorted(starts) == [0, 16, 32, 48, 64, 80]  # one epoch visits every window once
    assert [w.window_start(s) for s in range(6, 12)] != starts  # the next epoch has its own order
    assert torch.equal(ids[0], torch.cat([torch.arange(s, s + 16) for s in starts]))
    cuts = cu.tolist()
    assert cuts[0] == 0 and cuts[-1] == 96 and all(m * 16 in cuts for m in range(7))
    flat = np.concatenate([np.arange(s, s + 16) for s in starts])
    doc = np.searchsorted(corpus.doc_starts, flat, "right")
    for a, b in zip(cuts[:-1], cuts[1:]):  # every segment inside one document and one window
        assert b > a and len(set(doc[a:b])) == 1 and a // 16 == (b - 1) // 16


def test_ranks_split_the_global_batch():
    corpus = TokenCorpus(np.arange(4096) % 256, np.array([0]), np.ones(256, np.int64))
    w = PackedWindows(corpus, seq_len=32, seed=0)
    (whole,) = w.batches(8, 8)
    parts = [w.batches(8, 8, rank=r, world_size=2, micro_batches=2) for r in range(2)]
    joined = torch.cat([ids for p in parts for ids, _ in p], dim=1)
    assert torch.equal(joined, whole[0])
    with pytest.raises(ValueError, match="divisible"):
        w.batches(0, 6, world_size=4)
    rows = eval_batches(corpus, 32, num_batches=3, batch_size=4)
    assert len(rows) == 3 and all(r[0].shape == (1, 128) for r in rows)


def test_bpe_round_trip_and_bytes(tmp_path):
    texts = ["def add(a, b):\n    return a + b\n", "héllo wörld, ünïcode\n"] * 50
    tok = train_bpe(texts, 300, tmp_path / "tok.json")
    again = load_tokenizer(tmp_path / "tok.json")
    for t in texts[:2]:
        ids = again.encode(t)
        assert again.decode(ids) == t
        assert again.bytes_per_token()[ids].sum() == len(t.encode())
    assert 256 < again.vocab_size <= 300 and again.eos_id is not None
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(texts, 100)


def test_unigram_baseline_of_uniform_bytes_is_eight_bits():
    rng = np.random.default_rng(0)
    a = TokenCorpus(rng.integers(0, 256, 200_000).astype(np.uint8), np.array([0]), np.ones(256, np.int64))
    b = TokenCorpus(rng.integers(0, 256, 50_000).astype(np.uint8), np.array([0]), np.ones(256, np.int64))
    assert unigram_bits_per_byte(a, b, 256) == pytest.approx(8.0, abs=0.01)


def test_mqar_follows_zoology():
    V, T, P = 64, 64, 8
    x, y = mqar_batch(32, T, P, V, seed=5)
    assert x.shape == y.shape == (32, T)
    for n in range(32):
        keys, vals = x[n, 0 : 2 * P : 2], x[n, 1 : 2 * P : 2]
        assert len(set(keys.tolist())) == P and bool((keys >= 1).all() and (keys < V // 2).all())
        assert bool((vals >= V // 2).all() and (vals < V).all())
        q = (y[n] != -100).nonzero().flatten()
        assert len(q) == P and bool((q >= 2 * P).all()) and bool(((q - 2 * P) % 2 == 0).all())
        pair = dict(zip(keys.tolist(), vals.tolist()))
        for t in q.tolist():
            assert pair[int(x[n, t])] == int(y[n, t])  # query key -> its value
    gaps = torch.cat([((y[n] != -100).nonzero().flatten() - 2 * P) // 2 for n in range(32)])
    assert gaps.float().median() < (T - 2 * P) // 4  # power law: short gaps dominate
    assert torch.equal(mqar_batch(4, T, P, V, seed=1)[0], mqar_batch(4, T, P, V, seed=1)[0])
    with pytest.raises(ValueError, match="seq_len"):
        mqar_batch(2, 20, 8, 64)
    with pytest.raises(ValueError, match="vocab_size"):
        mqar_batch(2, 64, 8, 16)
    assert math.isclose(float((y != -100).sum()), 32 * P)


def test_bad_bin_files_are_one_line_errors(tmp_path):
    """A .bin whose size is not a whole number of ids, or whose ids exceed the tokenizer's
    vocabulary, is refused with the file named, before anything indexes with those ids."""
    tok = ByteTokenizer()
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\1\2\3")
    with pytest.raises(ValueError, match=r"odd\.bin.*3 bytes.*uint16"):
        load_corpus(str(odd), tok)
    big = tmp_path / "big.bin"
    big.write_bytes(np.array([1, 2, 300, 5], dtype=np.uint16).tobytes())
    with pytest.raises(ValueError, match=r"big\.bin.*300.*vocabulary of 256"):
        load_corpus(str(big), tok)


def test_missing_and_binary_text_sources_are_refused(tmp_path):
    tok = ByteTokenizer()
    blob = tmp_path / "blob.dat"
    blob.write_bytes(b"\0\1\2" * 100)
    with pytest.raises(ValueError, match=r"blob\.dat.*binary"):
        load_corpus(str(blob), tok)
    from gdn.data import iter_texts

    with pytest.raises(ValueError, match="no such file or folder"):
        list(iter_texts(str(tmp_path / "missing")))
    with pytest.raises(ValueError, match=r"blob\.dat.*binary"):
        list(iter_texts(str(blob)))


def test_missing_hf_path_is_a_clear_error(tmp_path):
    pytest.importorskip("datasets")
    with pytest.raises(ValueError, match=r"hf:/.*missing.*no such file or folder"):
        load_corpus(f"hf:{tmp_path / 'missing'}", ByteTokenizer())
