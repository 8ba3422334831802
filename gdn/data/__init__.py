"""Data: tokenizers (bytes, local BPE), corpora with a fixed held-out split, packing with
``cu_seqlens``, and the MQAR generator. Imports nothing else from ``gdn``."""
from __future__ import annotations

from .corpus import TokenCorpus, held_out, iter_texts, load_corpus, stdlib_root, unigram_bits_per_byte
from .mqar import mqar_batch
from .packing import PackedWindows, eval_batches
from .tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, train_bpe

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "PackedWindows",
    "TokenCorpus",
    "eval_batches",
    "held_out",
    "iter_texts",
    "load_corpus",
    "load_tokenizer",
    "mqar_batch",
    "stdlib_root",
    "train_bpe",
    "unigram_bits_per_byte",
]
