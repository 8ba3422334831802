"""Corpora as one token stream plus document offsets, split into train and held-out parts.

Sources (``load_corpus(spec, ...)``):

- ``None`` / ``"stdlib"``: the ``*.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded): tens of MB of real text on
  every machine, no download.
- a text file or a folder of text files (one document per file; binary files skipped);
- a ``.jsonl`` file (one document per line, the ``text_field`` of each object);
- a pre-tokenised ``.bin`` memmap of ids (``bin_dtype``); documents end at ``eos_id`` when given.
  A sibling file named with ``val`` instead of ``train`` is the held-out part when it exists;
- ``hf:NAME`` (a Hugging Face ``datasets`` name, needs the hub) or ``hf:PATH`` (local
  ``.parquet/.json/.jsonl/.csv/.arrow`` files, or a ``save_to_disk`` folder).

The held-out split is fixed: a document is held out when the hash of its key (relative path,
line number, record index) falls below ``val_fraction`` — the same files on every machine and
every run. Sources without a natural split (one file) hold out the tail of the stream instead.
"""
from __future__ import annotations

import hashlib
import json
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


@dataclass
class TokenCorpus:
    """``tokens`` [n] ids of all documents back to back; ``doc_starts`` [D] sorted offsets of the
    documents (``doc_starts[0] == 0``); ``bytes_per_token`` [vocab] UTF-8 bytes per id (bits per byte)."""

    tokens: np.ndarray
    doc_starts: np.ndarray
    bytes_per_token: np.ndarray
    name: str = ""

    def __post_init__(self):
        if self.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {self.tokens.shape}")
        ds = np.asarray(self.doc_starts, dtype=np.int64)
        if len(self.tokens) and (len(ds) == 0 or ds[0] != 0 or np.any(np.diff(ds) <= 0) or ds[-1] >= len(self.tokens)):
            raise ValueError("doc_starts must start at 0, increase strictly and stay below len(tokens)")
        self.doc_starts = ds

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_bytes(self) -> int:
        """UTF-8 bytes the stream stands for."""
        return int(self.bytes_per_token[np.asarray(self.tokens, dtype=np.int64)].sum())


def held_out(key: str, fraction: float) -> bool:
    """Whether the document called ``key`` is in the held-out split (fixed by a SHA-1 of the key)."""
    h = int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big")
    return h / 2.0**64 < fraction


def stdlib_root() -> Path:
    """The standard-library folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(4096)


def _text_documents(spec: str | None):
    """(key, text) of every document of a text source."""
    if spec is None or spec == "stdlib":
        root = stdlib_root()
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
        if not files:
            raise ValueError(f"no *.py files under the standard library folder {root}")
        for p in files:
            yield p.relative_to(root).as_posix(), p.read_text(encoding="utf-8", errors="replace")
        return
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"data {spec!r}: no such file or folder")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.parts))
        for p in files:
            if not _looks_binary(p):
                yield p.relative_to(path).as_posix(), p.read_text(encoding="utf-8", errors="replace")
    else:
        if _looks_binary(path):
            raise ValueError(f"data {spec!r} looks binary (it holds NUL bytes), not text; pre-tokenised ids go "
                             "in a .bin file (bin_dtype, eos_id)")
        yield path.name, path.read_text(encoding="utf-8", errors="replace")


def _jsonl_documents(path: Path, text_field: str):
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            if not isinstance(obj, dict) or text_field not in obj:
                raise ValueError(f"{path}:{i + 1}: expected a JSON object with a {text_field!r} field (text_field)")
            yield f"line{i}", str(obj[text_field])


def _hf_documents(name: str, text_field: str):
    """(split_name, key, text) of a ``datasets`` source."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"hf:{name} needs the datasets package: pip install 'datasets>=2.14' "
                         "(or '.[data]' in a clone of gdn)") from None

    path = Path(name)
    builders = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        ds = datasets.load_from_disk(str(path))
    elif path.exists():
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in builders)
        if not files:
            raise ValueError(f"hf:{name}: no {sorted(builders)} files there")
        ds = datasets.load_dataset(builders[files[0].suffix], data_files=[str(p) for p in files])
    elif name.startswith((".", "/", "~")) or Path(name).is_absolute():
        raise ValueError(f"hf:{name}: no such file or folder")
    else:
        try:
            ds = datasets.load_dataset(name)
        except Exception as e:  # noqa: BLE001 - hub, network and format errors alike
            raise ValueError(f"hf:{name}: the dataset could not be loaded ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); for local files use hf:PATH") from e
    if isinstance(ds, datasets.Dataset):
        ds = datasets.DatasetDict({"train": ds})
    for split, part in ds.items():
        if text_field not in part.column_names:
            raise ValueError(f"hf:{name} split {split!r} has no {text_field!r} column (columns: {part.column_names}); "
                             "set text_field")
        for i, text in enumerate(part[text_field]):
            yield split, f"{split}/{i}", str(text)


def _build(docs, tokenizer, name) -> TokenCorpus:
    """Tokenise (key, text) documents into one stream (an ``eos`` id closes each when the tokenizer has one)."""
    arrays, starts, n = [], [], 0
    eos = getattr(tokenizer, "eos_id", None)
    for _, text in docs:
        ids = tokenizer.encode_array(text)
        if eos is not None:
            ids = np.append(ids, np.asarray([eos], dtype=ids.dtype))
        if len(ids) == 0:
            continue
        arrays.append(ids)
        starts.append(n)
        n += len(ids)
    dtype = np.uint8 if tokenizer.vocab_size <= 256 else (np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32)
    tokens = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)
    return TokenCorpus(tokens, np.asarray(starts, dtype=np.int64), tokenizer.bytes_per_token(), name)


def _tail_split(corpus: TokenCorpus, fraction: float) -> tuple[TokenCorpus, TokenCorpus]:
    n = len(corpus)
    cut = n - max(1, int(round(n * fraction)))
    if cut <= 0:
        raise ValueError(f"{corpus.name}: {n} tokens are too few to hold out a validation part")
    ds = corpus.doc_starts
    train = TokenCorpus(corpus.tokens[:cut], ds[ds < cut], corpus.bytes_per_token, corpus.name + ":train")
    val_starts = np.concatenate([[0], ds[ds > cut] - cut]).astype(np.int64)
    val = TokenCorpus(corpus.tokens[cut:], val_starts, corpus.bytes_per_token, corpus.name + ":val")
    return train, val


def _bin_corpus(path: Path, dtype: str, eos_id: int | None, bytes_per_token, name) -> TokenCorpus:
    if dtype not in ("uint8", "uint16", "uint32", "int32"):
        raise ValueError(f"bin_dtype must be uint8, uint16, uint32 or int32, got {dtype!r}")
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(f"{path}: {size} bytes are not a whole number of {dtype} ids ({itemsize} bytes each); "
                         "set bin_dtype to the id type the file was written with")
    tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r") if size else np.zeros(0, dtype=dtype)
    top = int(tokens.max()) if len(tokens) else -1
    if top >= len(bytes_per_token):
        raise ValueError(f"{path}: id {top} exceeds the tokenizer's vocabulary of {len(bytes_per_token)}; "
                         "set tokenizer to the one that wrote the file (or bin_dtype to its id type)")
    if eos_id is None:
        starts = np.zeros(1, dtype=np.int64)
    else:
        starts = np.concatenate([[0], np.flatnonzero(tokens == eos_id) + 1]).astype(np.int64)
        starts = starts[starts < len(tokens)]
    return TokenCorpus(tokens, starts, bytes_per_token, name)


def load_corpus(spec: str | None, tokenizer, *, val_fraction: float = 0.02, text_field: str = "text",
                bin_dtype: str = "uint16", eos_id: int | None = None) -> tuple[TokenCorpus, TokenCorpus]:
    """``(train, val)`` :class:`TokenCorpus` of a source (see the module docstring)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    name = spec or "stdlib"
    if spec is not None and spec.startswith("hf:"):
        parts: dict[str, list] = {"train": [], "val": []}
        has_split = False
        for split, key, text in _hf_documents(spec[3:], text_field):
            if split in ("validation", "valid", "val", "test"):
                has_split = True
                parts["val"].append((key, text))
            else:
                parts["train"].append((key, text))
        if not has_split:
            docs = parts["train"]
            parts = {"train": [d for d in docs if not held_out(d[0], val_fraction)],
                     "val": [d for d in docs if held_out(d[0], val_fraction)]}
        train, val = _build(parts["train"], tokenizer, name + ":train"), _build(parts["val"], tokenizer, name + ":val")
        if len(val) == 0:
            return _tail_split(train, val_fraction)
        return train, val
    if spec is not None and not spec.startswith("hf:") and spec != "stdlib" and not Path(spec).exists():
        raise ValueError(f"data {spec!r} is neither an existing file/folder, 'stdlib' nor 'hf:NAME'")
    if spec is not None and spec.endswith(".bin"):
        path = Path(spec)
        bpt = tokenizer.bytes_per_token()
        train = _bin_corpus(path, bin_dtype, eos_id, bpt, name + ":train")
        sibling = path.with_name(path.name.replace("train", "val"))
        if "train" in path.name and sibling.exists():
            return train, _bin_corpus(sibling, bin_dtype, eos_id, bpt, str(sibling))
        return _tail_split(train, val_fraction)
    if spec is not None and spec.endswith(".jsonl"):
        docs = list(_jsonl_documents(Path(spec), text_field))
    else:
        docs = list(_text_documents(spec))
    if not docs:
        raise ValueError(f"data {name!r} holds no text documents")
    train_docs = [d for d in docs if not held_out(d[0], val_fraction)]
    val_docs = [d for d in docs if held_out(d[0], val_fraction)]
    if not val_docs or not train_docs:
        return _tail_split(_build(docs, tokenizer, name), val_fraction)
    train, val = _build(train_docs, tokenizer, name + ":train"), _build(val_docs, tokenizer, name + ":val")
    logger.info("corpus %s: %d train documents (%d tokens), %d held out (%d tokens)", name, len(train_docs),
                len(train), len(val_docs), len(val))
    return train, val


def iter_texts(spec: str | None, text_field: str = "text"):
    """Every document text of a text source (for fitting a tokenizer)."""
    if spec is not None and spec.startswith("hf:"):
        for _, _, text in _hf_documents(spec[3:], text_field):
            yield text
    elif spec is not None and spec.endswith(".jsonl"):
        for _, text in _jsonl_documents(Path(spec), text_field):
            yield text
    else:
        for _, text in _text_documents(spec):
            yield text


def unigram_bits_per_byte(train: TokenCorpus, val: TokenCorpus, vocab_size: int) -> float:
    """Bits per byte on ``val`` of the unigram model fitted on ``train`` (add-one smoothing): the
    baseline a language model must beat."""
    counts = np.bincount(np.asarray(train.tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log2(counts / counts.sum())
    vc = np.bincount(np.asarray(val.tokens, dtype=np.int64), minlength=vocab_size)
    return float(-(vc * logp).sum() / max(val.num_bytes, 1))
