"""Checkpoint directories that are complete or absent, and verified before they are loaded: the
one checkpoint module, written and resumed by :mod:`gdn.train`, loaded by :mod:`gdn.evaluation`
and the command line.

A checkpoint is ``OUT/checkpoints/step_XXXXXXXX/`` holding ``model.safetensors`` + ``config.json``
(Hugging Face layout, loadable by ``GDNForCausalLM.from_pretrained``), ``tokenizer.json``,
``train_config.yaml``, ``trainer.pt`` (step, data position, scheduler and RNG states; the
optimizer too for single-process runs — plain tensors and dicts, read with ``weights_only=True``),
``dcp/`` (``torch.distributed.checkpoint`` shards of model and optimizer, distributed runs), and
``manifest.json`` with the size and SHA-256 of every other file.

It is written into a hidden temporary folder, the manifest last (itself through a temporary file
and ``os.replace``), then the folder is renamed into place: a crash leaves either the previous
checkpoints or a complete new one. :func:`verify` recomputes every checksum; a missing, truncated
or altered file raises :class:`CheckpointError` naming it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupted."""


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoints_root(out: str | Path) -> Path:
    """``OUT/checkpoints``."""
    return Path(out) / "checkpoints"


def step_dir(out: str | Path, step: int) -> Path:
    """``OUT/checkpoints/step_XXXXXXXX``."""
    return checkpoints_root(out) / f"step_{step:08d}"


def temp_dir(out: str | Path, step: int) -> Path:
    """The hidden folder a checkpoint is assembled in before the rename."""
    return checkpoints_root(out) / f".step_{step:08d}.partial"


def step_of(directory: str | Path) -> int | None:
    """The step of a ``step_XXXXXXXX`` folder, None for another name."""
    m = _STEP_DIR.match(Path(directory).name)
    return int(m.group(1)) if m else None


def run_of(directory: str | Path) -> Path | None:
    """The run folder ``OUT`` of a checkpoint folder ``OUT/checkpoints/step_XXXXXXXX``, None for a
    folder elsewhere."""
    directory = Path(directory)
    if step_of(directory) is None or directory.parent.name != checkpoints_root("").name:
        return None
    return directory.parent.parent


def _file_mode(directory: Path) -> int:
    """The permission bits a file created with ``open`` gets here (0o666 less the umask, read from a
    probe file: ``os.umask`` can only be read by setting it, which races with other threads)."""
    probe = directory / f".mode{os.getpid()}"
    with open(probe, "w"):
        pass
    try:
        return probe.stat().st_mode & 0o777
    finally:
        probe.unlink()


def write_manifest(directory: Path, step: int, extra: dict | None = None) -> dict:
    """Checksum every file under ``directory`` into ``manifest.json`` (written atomically)."""
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not p.name.startswith("."):
            files[p.relative_to(directory).as_posix()] = {"bytes": p.stat().st_size, "sha256": sha256(p)}
    manifest = {"step": step, "files": files, **(extra or {})}
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def finalize(out: str | Path, step: int, keep_last: int, extra: dict | None = None) -> Path:
    """Give every file the same permissions (safetensors writes its file 0600, ``open`` 0666 less the
    umask: all get the latter), manifest, rename the temporary folder into place, drop all but the
    newest ``keep_last``."""
    tmp, final = temp_dir(out, step), step_dir(out, step)
    mode = _file_mode(tmp)
    for p in tmp.rglob("*"):
        if p.is_file() and p.stat().st_mode & 0o777 != mode:
            os.chmod(p, mode)
    write_manifest(tmp, step, extra)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(out)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    logger.info("checkpoint saved: %s", final)
    return final


def verify(directory: str | Path) -> dict:
    """The manifest of a complete, intact checkpoint; :class:`CheckpointError` otherwise."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {directory} does not exist")
    mpath = directory / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST}: it is partial (interrupted while saving?)")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {directory}: unreadable {MANIFEST} ({e})") from e
    for name, meta in files.items():
        p = directory / name
        if not p.is_file():
            raise CheckpointError(f"checkpoint {directory}: {name} is missing")
        if p.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"checkpoint {directory}: {name} has {p.stat().st_size} bytes, the manifest says "
                                  f"{meta['bytes']} (truncated or overwritten)")
        if sha256(p) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: {name} fails its SHA-256 check (corrupted)")
    return manifest


def list_checkpoints(out: str | Path) -> list[Path]:
    """Completed-looking checkpoint folders of a run, oldest first (not yet verified)."""
    return _step_dirs(checkpoints_root(out))


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def locate(spec: str | Path | bool, out: str | Path) -> Path:
    """The checkpoint folder named by ``--resume``, not yet verified: ``True`` (or ``"latest"``) = the
    newest under ``out``; a run folder = its newest; else the folder itself."""
    if spec is True or spec == "latest":
        base = Path(out)
    else:
        base = Path(spec)
    if (base / MANIFEST).exists() or _STEP_DIR.match(base.name):
        return base
    found = list_checkpoints(base)
    if not found:
        raise CheckpointError(f"{base} is not a checkpoint folder and {checkpoints_root(base)} holds no checkpoint")
    return found[-1]


def resolve(spec: str | Path | bool, out: str | Path) -> Path:
    """The checkpoint folder of :func:`locate`, verified. Raises :class:`CheckpointError`; for a
    damaged checkpoint the message also names the older checkpoints beside it that verify."""
    path = locate(spec, out)
    try:
        verify(path)
    except CheckpointError as e:
        step = step_of(path)
        if step is None:
            raise
        valid = [p for p in reversed(_step_dirs(path.parent)) if step_of(p) < step and _intact(p)]
        if valid:
            hint = (f"valid older checkpoints: {', '.join(p.name for p in valid)}; name one's folder to use it "
                    f"(e.g. {valid[0]})")
        else:
            hint = "no older checkpoint is valid"
        raise CheckpointError(f"{e}; {hint}") from None
    return path


def _intact(directory: Path) -> bool:
    try:
        verify(directory)
    except CheckpointError:
        return False
    return True


def find_model_dir(spec: str | Path) -> Path:
    """A folder with ``config.json`` + weights: ``spec`` itself, or the newest verified checkpoint of a run."""
    spec = Path(spec)
    if (spec / "config.json").is_file() and not (spec / "checkpoints").is_dir():
        if (spec / MANIFEST).exists():
            verify(spec)
        return spec
    return resolve(spec, spec)


def load_model(spec: str | Path, device: str | None = None):
    """``(model in eval mode, tokenizer, folder)`` from a checkpoint folder or a run folder (its newest
    verified checkpoint). Raises :class:`CheckpointError` for a corrupted or partial checkpoint."""
    import torch
    from safetensors.torch import load_file

    from .data import load_tokenizer
    from .models import GDNConfig, GDNForCausalLM

    path = find_model_dir(spec)
    config = GDNConfig.from_pretrained(str(path))
    model = GDNForCausalLM(config)
    weights = load_file(str(path / "model.safetensors"), device="cpu")
    if config.tie_word_embeddings:
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    model.load_state_dict(weights)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok = load_tokenizer(path / "tokenizer.json") if (path / "tokenizer.json").exists() else load_tokenizer("bytes")
    return model.to(device).eval(), tok, path
