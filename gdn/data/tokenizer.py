"""Tokenizers: raw bytes (the default, vocabulary 256) and a byte-level BPE fitted locally with
``tokenizers``. Both map text to a list of ids and back, and know how many UTF-8 bytes every id
stands for (for bits per byte).

Saved, both are transformers-native: ``save(directory)`` writes ``tokenizer.json`` (a
``tokenizers`` serialization), ``tokenizer_config.json`` (``"tokenizer_class":
"PreTrainedTokenizerFast"``, the bos/eos/pad tokens, no bos/eos added to encodings, no
clean-up of spaces on decode) and ``special_tokens_map.json``, so ``AutoTokenizer.from_pretrained``
loads the folder without gdn installed and gives the ids gdn gives.
:func:`load_tokenizer` reads those files, and the ``{"kind": "bytes"}`` file of older checkpoints.

The byte tokenizer's special token. transformers wants a bos/eos token; gdn's byte models have
none: their vocabulary is exactly the 256 byte values (training sets ``vocab_size`` from the
tokenizer, so the tiny byte model has no row for an id 256), and their corpora put nothing
between documents. An extra id 256 would index past the embedding of every such model, old
checkpoints included. So ``<|endoftext|>`` is id 255, the byte 0xFF, which never occurs in UTF-8:
no text encodes to it, so the ids of every text are still its UTF-8 bytes and the vocabulary is
still 256, for every byte model whatever its ``vocab_size``. It serves as bos, eos and pad; a
model never sees it in training, so generation with it as eos runs to ``max_new_tokens`` unless
the model emits 0xFF, which is not text anyway. ``split_special_tokens`` is on, so the literal
text ``<|endoftext|>`` encodes to its 13 bytes, as in gdn. In ``tokenizer.json`` each byte is
spelled as in ``tokenizers``' byte-level alphabet (the GPT-2 one), a BPE without merges over
those 256 symbols with the byte-level pre-tokenizer and decoder: ids are bytes, and decoding
replaces invalid UTF-8 by U+FFFD as :meth:`ByteTokenizer.decode` does. Decoding id 255 gives
``<|endoftext|>`` in transformers (or nothing, skipping special tokens) and U+FFFD in gdn.

The BPE keeps its own ``<|endoftext|>`` (the id after the merges) as bos, eos and pad; the
literal text ``<|endoftext|>`` encodes to that id in both, as ``tokenizers`` does by default.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

#: The special token of both tokenizers (bos, eos and pad for transformers).
EOS = "<|endoftext|>"
#: The byte tokenizer's id of :data:`EOS`: the byte 0xFF, which no UTF-8 text contains.
BYTE_EOS_ID = 0xFF


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def byte_symbols() -> list[str]:
    """The 256 one-character spellings ``tokenizers``' byte-level alphabet gives the bytes 0..255:
    printable Latin-1 bytes stand for themselves, the other 68 for U+0100, U+0101, … in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + shifted))
            shifted += 1
    return out


def _byte_vocab() -> dict[str, int]:
    vocab = {s: b for b, s in enumerate(byte_symbols())}
    del vocab[byte_symbols()[BYTE_EOS_ID]]
    vocab[EOS] = BYTE_EOS_ID
    return vocab


def _save_for_transformers(directory: str | Path, tokenizer_json: str, special: dict[int, str],
                           split_special_tokens: bool) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json`` in ``directory``;
    ``special``: {id: content} of the special tokens, the first one serving as bos, eos and pad."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write(directory / "tokenizer.json", tokenizer_json)
    roles = {}
    if special:
        token = next(iter(special.values()))
        roles = {"bos_token": token, "eos_token": token, "pad_token": token}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **roles,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": split_special_tokens,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, t in special.items()},
    }
    _write(directory / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    _write(directory / "special_tokens_map.json", json.dumps(roles, indent=2, ensure_ascii=False) + "\n")


class ByteTokenizer:
    """Text <-> UTF-8 bytes; ids 0..255. gdn adds no special token (``eos_id`` is None: nothing
    separates documents); for transformers, id 255 (0xFF) is ``<|endoftext|>`` (see the module)."""

    kind = "bytes"
    vocab_size = 256
    eos_id = None
    #: bos/eos/pad ids for a model config and ``generation_config.json``.
    special_token_ids = {"bos_token_id": BYTE_EOS_ID, "eos_token_id": BYTE_EOS_ID, "pad_token_id": BYTE_EOS_ID}

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

    def to_tokenizers(self):
        """The equivalent ``tokenizers.Tokenizer`` (what ``tokenizer.json`` holds)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
        return tok

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into
        ``directory`` (transformers' format, see the module)."""
        _save_for_transformers(directory, self.to_tokenizers().to_str(), {BYTE_EOS_ID: EOS},
                               split_special_tokens=True)


class BPETokenizer:
    """A ``tokenizers`` byte-level BPE; ``eos_id`` is the id of ``<|endoftext|>``."""

    kind = "bpe"
    EOS = EOS

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eos_id = tok.token_to_id(self.EOS)
        #: bos/eos/pad ids for a model config and ``generation_config.json`` (empty without ``<|endoftext|>``).
        self.special_token_ids = {} if self.eos_id is None else {
            "bos_token_id": self.eos_id, "eos_token_id": self.eos_id, "pad_token_id": self.eos_id}

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
        """Write ``tokenizer.json`` (the ``tokenizers`` format), ``tokenizer_config.json`` and
        ``special_tokens_map.json`` into ``directory`` (transformers' format, see the module)."""
        special = {} if self.eos_id is None else {self.eos_id: self.EOS}
        _save_for_transformers(directory, self._tok.to_str(), special, split_special_tokens=False)


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
    holding one) -> the tokenizer it describes: :class:`ByteTokenizer` for the file
    :meth:`ByteTokenizer.save` writes and for the ``{"kind": "bytes"}`` of older checkpoints,
    :class:`BPETokenizer` for any other ``tokenizers`` file."""
    if spec is None or spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"tokenizer must be 'bytes' or a tokenizer.json file/directory, got {spec!r}")
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    if data.get("kind") == "bytes" or (model.get("type") == "BPE" and not model.get("merges")
                                       and model.get("vocab") == _byte_vocab()):
        return ByteTokenizer()
    return BPETokenizer.from_file(path)
