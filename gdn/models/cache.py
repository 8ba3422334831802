"""The decoding cache of :class:`gdn.models.GDNForCausalLM`: one state per layer plus positions.

Besides what a forward call reads and writes, the cache copies sequences (:meth:`GDNCache.snapshot`,
:meth:`GDNCache.fork`, :meth:`GDNCache.restore`, :meth:`GDNCache.cat`) and, while it records
(:meth:`GDNCache.activate_past_recording`), rolls back the last tokens (:meth:`GDNCache.crop`), which
speculative decoding needs.

Rule the copies rely on: a forward call never writes into a state's tensors, it replaces the
layer's state object (the ops return new final states, attention concatenates). So a reference to
a state is a snapshot of it; the copies handed to users are still deep copies (:meth:`snapshot`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..layers.state import KVState, RecurrentState
from .registry import mixer

#: Default number of trailing tokens that :meth:`GDNCache.crop` can always remove while recording.
ROLLBACK_WINDOW = 256

State = RecurrentState | KVState | None


@dataclass
class _Call:
    """One recorded forward call: ``slots`` slots starting at slot ``start``.

    ``mask`` [B, slots] bool or None (all tokens). ``after[i]``: what gives layer i's state after the
    call: the state itself (recurrent layers, and window layers whose new keys were trimmed away), the
    call's new ``(key, value, valid)`` slots (window layers), or None (global attention: the current
    keys are sliced). ``replay(i, state_before, n)`` recomputes layer i's state after the call's
    first n slots from ``state_before`` (the model's mixer on the recorded inputs of that layer).
    """

    start: int
    slots: int
    mask: torch.Tensor | None
    after: list
    replay: Callable[[int, State, int], State]


class GDNCache:
    """Per-layer decoding state, usable by ``model.generate()`` and by :mod:`gdn.generation`.

    ``layers[i]`` is None before layer i has seen a token, then a :class:`RecurrentState`
    (conv tails + fp32 matrix state, constant in length) or a :class:`KVState` (keys/values;
    bounded by the window for sliding-window layers). ``seen`` counts the slots (tokens,
    padding included) processed; ``positions`` [B] the real tokens of each row, from which
    the RoPE position of the next token follows. ``embeds_prefix`` counts the slots fed as
    ``inputs_embeds`` rather than ids (``generate`` then keeps only the generated ids).

    It implements what ``transformers``' generation loop asks of a cache (``get_seq_length``,
    ``is_compileable``, ``reorder_cache`` for beam search, ``activate_past_recording`` / ``crop`` /
    ``is_croppable`` for assisted and prompt-lookup decoding) without subclassing ``Cache``, whose
    layer API is tied to key/value tensors.

    Per sequence: :meth:`snapshot` (deep copy of some rows), :meth:`fork` (one row repeated),
    :meth:`restore` (write a snapshot back, into all or some rows), :meth:`cat` (join caches along
    the batch), :meth:`index_select` (keep or reorder rows).

    Rolling back: a recurrent state cannot be cut back by slicing. While recording, every forward
    call through the model keeps the per-layer inputs of its last :attr:`rollback_window` tokens and
    the states at its start; :meth:`crop` then restores the state at a call boundary as it was, and
    inside a call recomputes each recurrent layer's state from the call's start over the kept inputs
    (one mixer call per layer, no MLP, no head). Attention keys and values are cut exactly.
    """

    is_compileable = False

    def __init__(self, num_layers: int, batch_size: int, device: torch.device | str | None = None,
                 recurrent_layers: list[bool] | None = None):
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.layers: list[State] = [None] * num_layers
        self.seen = 0
        self.embeds_prefix = 0
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._recurrent = list(recurrent_layers) if recurrent_layers is not None else [False] * num_layers
        self.rollback_window = ROLLBACK_WINDOW
        self._recording = False
        self._reset_history()

    @classmethod
    def for_config(cls, config, batch_size: int, device=None) -> "GDNCache":
        """An empty cache for a :class:`GDNConfig` and ``batch_size`` sequences."""
        return cls(config.num_hidden_layers, batch_size, device, [mixer(c).recurrent for c in config.layer_pattern])

    @property
    def batch_size(self) -> int:
        """Number of sequences B."""
        return self.positions.shape[0]

    @property
    def is_linear(self) -> list[bool]:
        """Per layer: True where the state does not keep tokens (recurrent mixers)."""
        return list(self._recurrent)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots processed so far (the length of the inputs already consumed, padding included)."""
        return self.seen

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """No fixed maximum: -1."""
        return -1

    def __len__(self) -> int:
        return len(self.layers)

    def nbytes(self) -> int:
        """Bytes held by all layer states."""
        return sum(s.nbytes() for s in self.layers if s is not None)

    def layer_nbytes(self) -> list[int]:
        """Bytes held by each layer's state (0 before it has seen a token)."""
        return [0 if s is None else s.nbytes() for s in self.layers]

    def advance(self, new_slots: int, new_tokens: torch.Tensor) -> None:
        """Record a forward call of ``new_slots`` slots holding ``new_tokens`` [B] real tokens per row."""
        self.seen += int(new_slots)
        self.positions = self.positions + new_tokens.to(self.positions.device, torch.long)

    # ----------------------------------------------------------------------------------------------
    # Rows: select, copy, fork, restore, join

    def index_select(self, index: torch.Tensor) -> None:
        """Keep (or reorder) batch rows: ``index`` [B'] long. Recorded history is dropped."""
        index = index.to(self.positions.device)
        self.layers = [None if s is None else s.index_select(index.to(_device(s))) for s in self.layers]
        self.positions = self.positions.index_select(0, index)
        self._reset_history()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows follow ``beam_idx`` [B]."""
        self.index_select(beam_idx)

    def _rows(self, index) -> torch.Tensor:
        if index is None:
            return torch.arange(self.batch_size, device=self.positions.device)
        if isinstance(index, (bool, str, bytes)) or not isinstance(index, (int, Sequence, torch.Tensor)):
            raise TypeError(f"index must be None, an int, a sequence of ints or a tensor, got {type(index).__name__}")
        idx = torch.as_tensor(index, dtype=torch.long, device=self.positions.device).reshape(-1)
        if idx.numel() == 0 or bool(((idx < 0) | (idx >= self.batch_size)).any()):
            raise ValueError(f"index must select rows in [0, {self.batch_size}), got {idx.tolist()}")
        return idx

    def _empty_like(self, batch_size: int) -> "GDNCache":
        new = GDNCache(len(self.layers), batch_size, self.positions.device, self._recurrent)
        new.rollback_window = self.rollback_window
        return new

    def snapshot(self, index=None) -> "GDNCache":
        """A new cache holding a deep copy of rows ``index`` (None: all; an int, ints or a [B'] tensor,
        in that order). It shares no tensor with this one and does not record."""
        rows = None if index is None else self._rows(index)
        new = self._empty_like(self.batch_size if rows is None else rows.numel())
        new.layers = [None if s is None else (_clone(s) if rows is None else s.index_select(rows.to(_device(s))))
                      for s in self.layers]
        new.positions = self.positions.clone() if rows is None else self.positions.index_select(0, rows)
        new.seen, new.embeds_prefix = self.seen, self.embeds_prefix
        return new

    def fork(self, index, n: int) -> "GDNCache":
        """A new cache with each row of ``index`` (an int, ints or a tensor) repeated ``n`` times in a row,
        e.g. ``fork(0, 4)``: four copies of sequence 0 (samples or beams sharing a prompt)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        return self.snapshot(self._rows(index).repeat_interleave(n))

    def restore(self, snapshot: "GDNCache", index=None) -> None:
        """Write ``snapshot`` back (a deep copy of it).

        ``index`` None: this cache becomes a copy of ``snapshot`` (any batch size). Otherwise
        ``snapshot``'s rows replace rows ``index`` (one per snapshot row) and the other rows are kept;
        attention layers whose cached lengths differ are left-padded with empty (masked) slots, and
        ``seen`` becomes the larger of the two. Recorded history is dropped.
        """
        if not isinstance(snapshot, GDNCache):
            raise TypeError(f"snapshot must be a GDNCache, got {type(snapshot).__name__}")
        if len(snapshot.layers) != len(self.layers) or snapshot._recurrent != self._recurrent:
            raise ValueError("the snapshot comes from a model with another layer pattern")
        if index is None:
            copy = snapshot.snapshot()
            self.layers, self.positions = copy.layers, copy.positions.to(self.positions.device)
            self.seen, self.embeds_prefix = copy.seen, copy.embeds_prefix
            self._reset_history()
            return
        rows = self._rows(index)
        if rows.numel() != snapshot.batch_size:
            raise ValueError(f"index selects {rows.numel()} rows but the snapshot holds {snapshot.batch_size}")
        if rows.unique().numel() != rows.numel():
            raise ValueError(f"index must not repeat a row, got {rows.tolist()}")
        B, n = self.batch_size, snapshot.batch_size
        layers = []
        for mine, theirs in zip(self.layers, snapshot.layers):
            if mine is None and theirs is None:
                layers.append(None)
                continue
            mine = mine if mine is not None else _empty_state(theirs, B)
            theirs = theirs if theirs is not None else _empty_state(mine, n)
            if isinstance(mine, KVState):
                slots = max(mine.key.shape[1], theirs.key.shape[1])
                mine, theirs = _pad_kv(mine, slots), _pad_kv(theirs, slots)
            layers.append(_write_rows(mine, theirs, rows.to(_device(mine))))
        self.layers = layers
        self.positions = self.positions.index_copy(0, rows, snapshot.positions.to(self.positions.device))
        self.seen = max(self.seen, snapshot.seen)
        self.embeds_prefix = max(self.embeds_prefix, snapshot.embeds_prefix)
        self._reset_history()

    @classmethod
    def cat(cls, caches: Sequence["GDNCache"]) -> "GDNCache":
        """One cache holding the rows of ``caches`` in order (copies). Attention layers of different
        cached lengths are left-padded with empty (masked) slots, as a left-padded batch would be;
        ``seen`` is the largest. Decoding the joined cache equals decoding each alone."""
        caches = list(caches)
        if not caches or not all(isinstance(c, GDNCache) for c in caches):
            raise TypeError("cat takes a non-empty sequence of GDNCache")
        first = caches[0]
        if any(len(c.layers) != len(first.layers) or c._recurrent != first._recurrent for c in caches):
            raise ValueError("the caches come from models with different layer patterns")
        new = first._empty_like(sum(c.batch_size for c in caches))
        for i in range(len(first.layers)):
            states = [c.layers[i] for c in caches]
            template = next((s for s in states if s is not None), None)
            if template is None:
                continue
            states = [s if s is not None else _empty_state(template, c.batch_size) for s, c in zip(states, caches)]
            if isinstance(template, KVState):
                slots = max(s.key.shape[1] for s in states)
                states = [_pad_kv(s, slots) for s in states]
                new.layers[i] = KVState(torch.cat([s.key for s in states]), torch.cat([s.value for s in states]),
                                        torch.cat([s.valid for s in states]), template.window,
                                        max(s.seen for s in states))
            else:
                new.layers[i] = RecurrentState(tuple(torch.cat(cs) for cs in zip(*(s.conv for s in states))),
                                               torch.cat([s.recurrent for s in states]))
        new.positions = torch.cat([c.positions.to(first.positions.device) for c in caches])
        new.seen = max(c.seen for c in caches)
        new.embeds_prefix = max(c.embeds_prefix for c in caches)
        return new

    def compact(self) -> int:
        """Drop the leading cached slots that no row attends to (masked in every row of every global
        attention layer), e.g. after :meth:`restore` replaced long rows with short ones; ``seen`` goes
        down by as many. Decoding is unchanged. Returns the number of slots dropped."""
        globals_ = [s for s in self.layers if isinstance(s, KVState) and s.window is None]
        if not globals_:
            return 0
        drop = min(int(s.valid.any(0).long().cummax(0).values.eq(0).sum()) for s in globals_)
        drop = min(drop, self.seen)
        if drop == 0:
            return 0
        self.layers = [KVState(s.key[:, drop:].contiguous(), s.value[:, drop:].contiguous(),
                               s.valid[:, drop:].contiguous(), None, s.seen - drop)
                       if isinstance(s, KVState) and s.window is None else s for s in self.layers]
        self.seen -= drop
        self._reset_history()
        return drop

    # ----------------------------------------------------------------------------------------------
    # Rolling back (speculative decoding)

    @property
    def recording(self) -> bool:
        """True while forward calls keep what :meth:`crop` needs (see :meth:`activate_past_recording`)."""
        return self._recording

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can remove tokens: while recording."""
        return self._recording

    def activate_past_recording(self, rollback_window: int | None = None, *,
                                recurrent_states_to_keep: int | None = None) -> None:
        """Start recording: from now on :meth:`crop` can remove at least the last ``rollback_window``
        tokens (default :data:`ROLLBACK_WINDOW`; everything since the last crop when fewer). A forward
        call longer than the window runs in two segments, the head unrecorded. ``transformers``'
        assisted decoding calls this; plain decoding never records and pays nothing.

        ``recurrent_states_to_keep`` is ``transformers``' name for the fewest tokens a crop must be
        able to remove: it raises the window when larger and never lowers it, so a draft length
        that grows between rounds stays within reach."""
        for name, n in (("rollback_window", rollback_window), ("recurrent_states_to_keep", recurrent_states_to_keep)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if rollback_window is not None:
            self.rollback_window = rollback_window
        if recurrent_states_to_keep is not None:
            self.rollback_window = max(self.rollback_window, recurrent_states_to_keep)
        self._recording = True
        self._reset_history()

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """How many of the last tokens :meth:`crop` can remove: the window while recording, else 0
        (``transformers``' query; every layer answers the same)."""
        return self.rollback_window if self._recording else 0

    def deactivate_past_recording(self) -> None:
        """Stop recording and drop what was kept."""
        self._recording = False
        self._reset_history()

    def _reset_history(self) -> None:
        self._base_layers = list(self.layers)
        self._base_seen = self.seen
        self._base_positions = self.positions
        self._calls: list[_Call] = []

    def begin_call(self) -> None:
        """Called by the model before a recorded forward call: history that no longer ends at the
        current state (the cache was changed without recording) is dropped."""
        if self.seen != self._base_seen + sum(c.slots for c in self._calls):
            self._reset_history()

    def end_call(self, start: int, slots: int, mask: torch.Tensor | None,
                 replay: Callable[[int, State, int], State]) -> None:
        """Called by the model after a recorded forward call of ``slots`` slots from slot ``start``
        (the cache already advanced); ``mask`` and ``replay`` as in :class:`_Call`."""
        after = []
        for s in self.layers:
            if isinstance(s, KVState) and s.window is None:
                after.append(None)
            elif isinstance(s, KVState) and s.key.shape[1] >= slots:
                after.append((s.key[:, -slots:].clone(), s.value[:, -slots:].clone(), s.valid[:, -slots:].clone(),
                              s.window))
            else:
                after.append(s)
        self._calls.append(_Call(start, slots, mask, after, replay))
        # Keep at least the last rollback_window tokens; drop older calls into the base.
        while len(self._calls) > 1 and sum(c.slots for c in self._calls[1:]) >= self.rollback_window:
            first = self._calls.pop(0)  # (global attention layers' base entries go None: never read)
            self._base_layers = [self._state_after(first, i, self._base_layers[i]) for i in range(len(self.layers))]
            self._base_positions = self._base_positions + _counts(first.mask, first.slots, self._base_positions)
            self._base_seen = first.start + first.slots

    def _state_after(self, call: _Call, i: int, before: State) -> State:
        """Layer i's state after the whole ``call`` whose start state was ``before`` (global
        attention layers excepted: those are sliced from the current state)."""
        a = call.after[i]
        if isinstance(a, tuple):
            return _append_kv(before, *a, slots=call.slots)
        return a

    def crop(self, max_length: int) -> None:
        """Remove the last tokens, in ``transformers``' sense: ``max_length < 0`` removes
        ``-max_length`` slots (0 removes none), ``max_length > 0`` keeps the first ``max_length``.

        Needs recording (:meth:`activate_past_recording`) unless nothing is removed. A cut at the
        boundary of two forward calls gives back the states as they were; a cut inside a call
        recomputes the recurrent layers' states over the kept part of that call (exact: the same
        mixer on the same inputs, from the call's starting state) and slices attention keys.
        What was recorded is then dropped (recording goes on).
        """
        if isinstance(max_length, torch.Tensor) and max_length.dim() == 0 and not max_length.is_floating_point():
            max_length = int(max_length)  # some transformers versions pass the count as a tensor
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise TypeError(f"max_length must be an int, got {max_length!r}")
        target = self.seen + max_length if max_length <= 0 else min(max_length, self.seen)
        if target == self.seen:
            if self._recording:
                self._reset_history()
            return
        if target < 0:
            raise ValueError(f"cannot remove {-max_length} slots from a cache of {self.seen}")
        if not self._recording:
            raise RuntimeError("crop needs a recording cache: call cache.activate_past_recording() before the "
                               "forward calls to be rolled back")
        if target < self._base_seen:
            raise ValueError(f"cannot roll back to slot {target}: only slots from {self._base_seen} on were "
                             f"recorded (raise cache.rollback_window, now {self.rollback_window})")
        layers, positions = list(self._base_layers), self._base_positions
        for call in self._calls:
            if target <= call.start:
                break
            n = min(call.slots, target - call.start)
            for i in range(len(layers)):
                cur = self.layers[i]
                if isinstance(cur, KVState) and cur.window is None:
                    continue  # sliced from the current keys below
                if n == call.slots:
                    layers[i] = self._state_after(call, i, layers[i])
                elif isinstance(call.after[i], tuple):
                    k, v, m, window = call.after[i]
                    layers[i] = _append_kv(layers[i], k[:, :n], v[:, :n], m[:, :n], window, slots=n)
                else:
                    with torch.no_grad():
                        layers[i] = call.replay(i, layers[i], n)
            positions = positions + _counts(None if call.mask is None else call.mask[:, :n], n, positions)
        drop = self.seen - target
        for i, cur in enumerate(self.layers):
            if isinstance(cur, KVState) and cur.window is None:
                keep = cur.key.shape[1] - drop
                layers[i] = KVState(cur.key[:, :keep], cur.value[:, :keep], cur.valid[:, :keep], None, cur.seen - drop)
        self.layers, self.positions, self.seen = layers, positions, target
        self._reset_history()


def _device(state) -> torch.device:
    return state.recurrent.device if isinstance(state, RecurrentState) else state.key.device


def _counts(mask: torch.Tensor | None, slots: int, like: torch.Tensor) -> torch.Tensor:
    """Real tokens per row among ``slots`` slots with ``mask`` [B, slots] (None: all real)."""
    if mask is None:
        return torch.full_like(like, slots)
    return mask.sum(1).to(like.device, like.dtype)


def _clone(s):
    if isinstance(s, RecurrentState):
        return RecurrentState(tuple(c.clone() for c in s.conv), s.recurrent.clone())
    return KVState(s.key.clone(), s.value.clone(), s.valid.clone(), s.window, s.seen)


def _empty_state(template, batch_size: int):
    """The state of ``batch_size`` rows that have seen nothing, shaped like ``template``'s."""
    if isinstance(template, RecurrentState):
        return RecurrentState(tuple(c.new_zeros(batch_size, *c.shape[1:]) for c in template.conv),
                              template.recurrent.new_zeros(batch_size, *template.recurrent.shape[1:]))
    k, v = template.key, template.value
    return KVState(k.new_zeros(batch_size, 0, *k.shape[2:]), v.new_zeros(batch_size, 0, *v.shape[2:]),
                   template.valid.new_zeros(batch_size, 0), template.window, 0)


def _pad_kv(s: KVState, slots: int) -> KVState:
    """Left-pad ``s`` to ``slots`` cached slots with zero keys marked invalid (never attended)."""
    pad = slots - s.key.shape[1]
    if pad <= 0:
        return s
    B = s.key.shape[0]
    return KVState(torch.cat([s.key.new_zeros(B, pad, *s.key.shape[2:]), s.key], 1),
                   torch.cat([s.value.new_zeros(B, pad, *s.value.shape[2:]), s.value], 1),
                   torch.cat([s.valid.new_zeros(B, pad), s.valid], 1), s.window, s.seen)


def _write_rows(dst, src, rows: torch.Tensor):
    """``dst`` with rows ``rows`` replaced by ``src``'s rows (new tensors)."""
    if isinstance(dst, RecurrentState):
        return RecurrentState(tuple(d.index_copy(0, rows, s.to(d.dtype)) for d, s in zip(dst.conv, src.conv)),
                              dst.recurrent.index_copy(0, rows, src.recurrent.to(dst.recurrent.dtype)))
    return KVState(dst.key.index_copy(0, rows, src.key.to(dst.key.dtype)),
                   dst.value.index_copy(0, rows, src.value.to(dst.value.dtype)),
                   dst.valid.index_copy(0, rows, src.valid), dst.window, max(dst.seen, src.seen))


def _append_kv(before: KVState | None, key, value, valid, window: int, *, slots: int) -> KVState:
    """A sliding-window layer's state after ``before`` plus ``slots`` new slots (their keys, values
    and validity), keeping the last ``window - 1`` slots as the layer does."""
    if before is not None:
        key, value, valid = (torch.cat([a, b], 1) for a, b in ((before.key, key), (before.value, value),
                                                               (before.valid, valid)))
    seen = (0 if before is None else before.seen) + slots
    keep = min(window - 1, key.shape[1])
    return KVState(key[:, key.shape[1] - keep:].contiguous(), value[:, value.shape[1] - keep:].contiguous(),
                   valid[:, valid.shape[1] - keep:].contiguous(), window, seen)
