"""GDNCache per sequence (snapshot, fork, restore, cat) and rolling back (recording + crop), on a
model with every kind of state: Gated DeltaNet (G), sliding-window (S) and global (A) attention."""
from __future__ import annotations

import pytest
import torch

from gdn.layers.state import KVState, RecurrentState
from gdn.models import GDNCache, GDNConfig, GDNForCausalLM, output_cache

V = 256


@pytest.fixture(scope="module")
def model():
    """G, S (window 4: the window fills within a few tokens) and A layers, fp64 so that tolerances are tight."""
    torch.manual_seed(0)
    cfg = GDNConfig.from_preset("gdn", "tiny", hidden_size=32, num_hidden_layers=3, head_dim=16, intermediate_size=64,
                                layer_pattern="GSA", window_size=4)
    return GDNForCausalLM(cfg).double().eval()


def ids(B, T, seed=0):
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def run(m, x, cache=None):
    """Feed x [B, T] (one call) and return (logits [B, T, V], cache)."""
    out = m(x, past_key_values=cache, use_cache=True)
    return out.logits, output_cache(out)


def tensors(state):
    if isinstance(state, RecurrentState):
        return [*state.conv, state.recurrent]
    return [state.key, state.value, state.valid]


def assert_same_cache(a: GDNCache, b: GDNCache, rtol=0.0):
    """Equal states, positions and lengths: bit for bit (rtol=0) or within relative RMS ``rtol``."""
    assert a.seen == b.seen and torch.equal(a.positions, b.positions)
    for sa, sb in zip(a.layers, b.layers):
        assert type(sa) is type(sb)
        if isinstance(sa, KVState):
            assert sa.seen == sb.seen and sa.window == sb.window
        for ta, tb in zip(tensors(sa), tensors(sb)):
            assert ta.shape == tb.shape
            if rtol == 0 or ta.dtype == torch.bool:
                assert torch.equal(ta, tb)
            else:
                assert ((ta - tb).norm() / tb.norm().clamp_min(1e-30)).item() <= rtol


def test_snapshot_is_a_deep_copy_of_the_chosen_rows(model):
    _, cache = run(model, ids(3, 7))
    snap = cache.snapshot()
    assert_same_cache(snap, cache)
    ptrs = {t.data_ptr() for s in cache.layers for t in tensors(s)}
    assert not ptrs & {t.data_ptr() for s in snap.layers for t in tensors(s)}
    run(model, ids(3, 2, seed=1), cache)  # the original moves on, the copy does not
    assert snap.seen == 7 and cache.seen == 9 and snap.positions.tolist() == [7, 7, 7]
    rows = snap.snapshot([2, 0])
    assert rows.batch_size == 2 and rows.seen == 7
    assert torch.equal(rows.layers[0].recurrent, snap.layers[0].recurrent[[2, 0]])
    assert torch.equal(rows.layers[2].key, snap.layers[2].key[[2, 0]])
    assert snap.snapshot(1).batch_size == 1 and not snap.snapshot().recording
    with pytest.raises(ValueError, match="rows"):
        snap.snapshot([3])
    with pytest.raises(TypeError, match="index"):
        snap.snapshot("0")


def test_fork_continues_each_copy_like_the_original(model):
    x = ids(2, 6)
    _, cache = run(model, x)
    forked = cache.fork(1, 3)
    assert forked.batch_size == 3 and forked.seen == 6
    nxt = ids(1, 4, seed=2)
    a, _ = run(model, nxt.expand(3, -1), forked)
    b, _ = run(model, nxt, cache.snapshot(1))
    for r in range(3):
        assert torch.allclose(a[r], b[0], rtol=1e-12, atol=1e-12)
    assert cache.fork([0, 1], 2).batch_size == 4
    with pytest.raises(ValueError, match="positive"):
        cache.fork(0, 0)


def test_restore_whole_and_into_rows_with_other_lengths(model):
    x = ids(2, 9, seed=3)
    _, cache = run(model, x[:, :5])
    snap = cache.snapshot()
    run(model, x[:, 5:], cache)
    cache.restore(snap)  # back to 5 slots: continuing gives what continuing the snapshot gives
    assert_same_cache(cache, snap)
    a, _ = run(model, x[:, 5:], cache)
    b, _ = run(model, x[:, 5:], snap.snapshot())
    assert torch.equal(a, b)
    # A prompt of another length replaces row 1 of a batch; row 0 goes on as before.
    other = ids(1, 3, seed=4)
    _, two = run(model, x[:, :6])
    _, alone = run(model, other)
    two.restore(alone, index=[1])
    assert two.seen == 6 and two.positions.tolist() == [6, 3]
    assert two.layers[2].key.shape[1] == 6 and two.layers[2].valid[1].tolist() == [False] * 3 + [True] * 3
    step = ids(2, 3, seed=5)
    got, _ = run(model, step, two)
    row0, _ = run(model, step[:1], run(model, x[:1, :6])[1])
    row1, _ = run(model, step[1:], alone)
    assert torch.allclose(got[0], row0[0], rtol=1e-10, atol=1e-10)
    assert torch.allclose(got[1], row1[0], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="rows but the snapshot"):
        two.restore(alone, index=[0, 1])
    with pytest.raises(ValueError, match="layer pattern"):
        two.restore(GDNCache(2, 1))


def test_cat_of_different_lengths_decodes_like_each_alone(model):
    prompts = [ids(1, 7, seed=6), ids(1, 2, seed=7), ids(1, 5, seed=8)]
    caches = [run(model, p)[1] for p in prompts]
    joined = GDNCache.cat(caches)
    assert joined.batch_size == 3 and joined.seen == 7 and joined.positions.tolist() == [7, 2, 5]
    assert joined.layers[1].key.shape[1] == 3  # window 4: the last 3 slots
    step = ids(3, 4, seed=9)
    got, _ = run(model, step, joined)
    for r, c in enumerate(caches):
        want, _ = run(model, step[r:r + 1], c.snapshot())
        assert torch.allclose(got[r], want[0], rtol=1e-10, atol=1e-10)
    with pytest.raises(TypeError):
        GDNCache.cat([])


def test_crop_needs_recording_and_removes_nothing_for_zero(model):
    _, cache = run(model, ids(1, 5))
    assert not cache.is_croppable and not cache.recording
    cache.crop(0)
    cache.crop(5)  # keep the first 5 of 5: nothing to do
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        cache.crop(-1)
    cache.activate_past_recording()
    assert cache.is_croppable
    with pytest.raises(ValueError, match="only slots from 5"):
        cache.crop(-1)  # nothing recorded yet
    with pytest.raises(TypeError):
        cache.crop(1.5)


@pytest.mark.parametrize("removed", [1, 3, 6])
def test_crop_equals_running_only_the_kept_tokens(model, removed):
    """Calls of 4, 1 and 3 tokens are recorded after a 5-token prefill; removing 1 or 3 cuts into
    the last call (states recomputed over its kept part), 6 cuts into the first (and drops two
    calls). The cropped cache equals the cache of the kept tokens fed the same way, and decoding on
    from it gives the same logits."""
    x = ids(2, 16, seed=10)
    _, cache = run(model, x[:, :5])
    cache.activate_past_recording()
    for lo, hi in ((5, 9), (9, 10), (10, 13)):
        run(model, x[:, lo:hi], cache)
    cache.crop(-removed)
    keep = 13 - removed
    assert cache.seen == keep and cache.positions.tolist() == [keep, keep]
    _, ref = run(model, x[:, :5])
    bounds = [b for b in (9, 10) if b < keep] + [keep]
    lo = 5
    for hi in bounds:
        run(model, x[:, lo:hi], ref)
        lo = hi
    assert_same_cache(cache, ref, rtol=1e-12)
    a, _ = run(model, x[:, keep:], cache)
    b, _ = run(model, x[:, keep:], ref)
    assert torch.allclose(a, b, rtol=1e-10, atol=1e-10)


def test_crop_at_a_call_boundary_restores_the_states_bit_for_bit(model):
    x = ids(1, 12, seed=11)
    _, cache = run(model, x[:, :4])
    cache.activate_past_recording()
    run(model, x[:, 4:7], cache)
    snap = cache.snapshot()
    run(model, x[:, 7:8], cache)
    run(model, x[:, 8:12], cache)
    cache.crop(-5)
    assert_same_cache(cache, snap)
    cache.crop(7)  # positive: keep the first 7 slots (already so)
    assert cache.seen == 7


def test_recording_leaves_the_forward_unchanged_and_plain_calls_do_no_bookkeeping(model, monkeypatch):
    x = ids(2, 9, seed=12)
    plain, _ = run(model, x)
    rec = GDNCache.for_config(model.config, 2)
    rec.activate_past_recording()
    recorded, _ = run(model, x, rec)
    assert torch.equal(plain, recorded)
    calls = []
    monkeypatch.setattr(GDNCache, "end_call", lambda self, *a: calls.append(a))
    run(model, x, None)
    model.generate(x[:1], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert calls == []


def test_a_long_call_records_only_its_last_rollback_window_tokens(model):
    x = ids(1, 20, seed=13)
    cache = GDNCache.for_config(model.config, 1)
    cache.activate_past_recording(rollback_window=4)
    logits, _ = run(model, x[:, :15], cache)
    whole, _ = run(model, x[:, :15])
    assert torch.allclose(logits, whole, rtol=1e-10, atol=1e-10)  # head and tail segments = one call
    with pytest.raises(ValueError, match="rollback_window"):
        cache.crop(-5)
    cache.crop(-4)
    _, ref = run(model, x[:, :11])
    assert_same_cache(cache, ref, rtol=1e-12)
    # Many one-token calls: at least the last rollback_window stay recorded, older ones are folded away.
    for t in range(11, 20):
        run(model, x[:, t:t + 1], cache)
    assert len(cache._calls) <= 5
    cache.crop(-4)
    _, ref = run(model, x[:, :16])
    assert_same_cache(cache, ref, rtol=1e-12)
    with pytest.raises(ValueError, match="positive"):
        cache.activate_past_recording(rollback_window=0)


def test_transformers_keyword_raises_the_window_and_never_lowers_it(model):
    """``recurrent_states_to_keep`` (the name newer transformers pass) is a lower bound on what a crop
    can remove; ``get_recurrent_states_to_keep`` reports the window while recording, 0 otherwise."""
    cache = GDNCache.for_config(model.config, 1)
    assert cache.get_recurrent_states_to_keep() == 0
    cache.activate_past_recording(rollback_window=4)
    cache.activate_past_recording(recurrent_states_to_keep=2)
    assert cache.get_recurrent_states_to_keep() == 4
    cache.activate_past_recording(recurrent_states_to_keep=6)
    assert cache.rollback_window == 6 and cache.get_recurrent_states_to_keep(0) == 6
    x = ids(1, 12, seed=14)
    for t in range(12):
        run(model, x[:, t:t + 1], cache)
    cache.crop(-6)
    _, ref = run(model, x[:, :6])
    assert_same_cache(cache, ref, rtol=1e-12)
    cache.deactivate_past_recording()
    assert cache.get_recurrent_states_to_keep() == 0
    with pytest.raises(ValueError, match="recurrent_states_to_keep"):
        cache.activate_past_recording(recurrent_states_to_keep=0)
