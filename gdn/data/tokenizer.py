"""Tokenizers: raw bytes (the default, vocabulary 256) and a byte-level BPE fitted locally with
``tokenizers``. Both map text to a list of ids and back, and know how many UTF-8 bytes every id
stands for (for bits per byte)."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


class ByteTokenizer:
    """Text <-> UTF-8 bytes; ids 0..255, no special tokens."""

    kind = "bytes"
    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> list[int]:
        """``text`` -> list of byte values."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """``text`` -> [n] uint8 array of its UTF-8 bytes."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text (invalid UTF-8 replaced by U+FFFD)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def bytes_per_token(self) -> np.ndarray:
        """[vocab] the number of UTF-8 bytes every id stands for (all 1)."""
        return np.ones(256, dtype=np.int64)

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` (``{"kind": "bytes"}``) into ``directory``."""
        Path(directory, "tokenizer.json").write_text(json.dumps({"kind": "bytes"}))


class BPETokenizer:
    """A ``tokenizers`` byte-level BPE; ``eos_id`` is the id of ``<|endoftext|>``."""

    kind = "bpe"
    EOS = "<|endoftext|>"

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eos_id = tok.token_to_id(self.EOS)

    @classmethod
    def from_file(cls, path: str | Path) -> "BPETokenizer":
        """Load a tokenizer written by :func:`train_bpe` (a ``tokenizers`` JSON file)."""
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        """``text`` -> list of ids."""
        return self._tok.encode(text).ids

    def encode_array(self, text: str) -> np.ndarray:
        """``text`` -> [n] array of ids (uint16 when the vocabulary fits, else uint32)."""
        return np.asarray(self.encode(text), dtype=np.uint16 if self.vocab_size <= 65536 else np.uint32)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once (parallel inside ``tokenizers``)."""
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text."""
        return self._tok.decode([int(i) for i in ids])

    def bytes_per_token(self) -> np.ndarray:
        """[vocab] UTF-8 bytes each id decodes to (0 for special tokens)."""
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            if i != self.eos_id:
                out[i] = len(self._tok.decode([i], skip_special_tokens=True).encode("utf-8"))
        return out

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` (the ``tokenizers`` format) into ``directory``."""
        self._tok.save(str(Path(directory, "tokenizer.json")))


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | Path | None = None) -> BPETokenizer:
    """Fit a byte-level BPE of ``vocab_size`` ids (256 byte symbols + merges + ``<|endoftext|>``)
    on ``texts``; write it to ``out`` (a ``.json`` file) when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or vocab_size < 258:
        raise ValueError(f"vocab_size must be an int >= 258 (256 bytes + eos + a merge), got {vocab_size!r}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPETokenizer.EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bpe = BPETokenizer(tok)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(out))
        logger.info("wrote a %d-id BPE tokenizer to %s", bpe.vocab_size, out)
    return bpe


def load_tokenizer(spec: str | Path | None):
    """``None``/``"bytes"`` -> :class:`ByteTokenizer`; a ``tokenizer.json`` path (or a directory
    holding one) -> the tokenizer it describes."""
    if spec is None or spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"tokenizer must be 'bytes' or a tokenizer.json file/directory, got {spec!r}")
    data = json.loads(path.read_text())
    if data.get("kind") == "bytes":
        return ByteTokenizer()
    return BPETokenizer.from_file(path)
