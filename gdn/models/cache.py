"""The decoding cache of :class:`gdn.models.GDNForCausalLM`: one state per layer plus positions."""
from __future__ import annotations

import torch

from ..layers.state import KVState, RecurrentState
from .registry import mixer


class GDNCache:
    """Per-layer decoding state, usable by ``model.generate()`` and by :mod:`gdn.generation`.

    ``layers[i]`` is None before layer i has seen a token, then a :class:`RecurrentState`
    (conv tails + fp32 matrix state, constant in length) or a :class:`KVState` (keys/values;
    bounded by the window for sliding-window layers). ``seen`` counts the slots (tokens,
    padding included) processed; ``positions`` [B] the real tokens of each row, from which
    the RoPE position of the next token follows. ``embeds_prefix`` counts the slots fed as
    ``inputs_embeds`` rather than ids (``generate`` then keeps only the generated ids).

    It implements what ``transformers``' generation loop asks of a cache (``get_seq_length``,
    ``is_compileable``, ``reorder_cache`` for beam search) without subclassing ``Cache``, whose
    layer API is tied to key/value tensors.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, num_layers: int, batch_size: int, device: torch.device | str | None = None,
                 recurrent_layers: list[bool] | None = None):
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.layers: list[RecurrentState | KVState | None] = [None] * num_layers
        self.seen = 0
        self.embeds_prefix = 0
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=device)
        self._recurrent = list(recurrent_layers) if recurrent_layers is not None else [False] * num_layers

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

    def index_select(self, index: torch.Tensor) -> None:
        """Keep (or reorder) batch rows: ``index`` [B'] long."""
        index = index.to(self.positions.device)
        self.layers = [None if s is None else s.index_select(index.to(_device(s))) for s in self.layers]
        self.positions = self.positions.index_select(0, index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows follow ``beam_idx`` [B]."""
        self.index_select(beam_idx)


def _device(state) -> torch.device:
    return state.recurrent.device if isinstance(state, RecurrentState) else state.key.device
