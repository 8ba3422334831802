"""Training configuration: one flat dataclass, loaded from YAML/JSON, overridden by flags and
``--set key=value`` (``model.KEY=VALUE`` sets a :class:`gdn.models.GDNConfig` field), saved
beside every run. A resumed run starts from the settings saved in its checkpoint
(:func:`resume_config`)."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .. import checkpoint as ckpt
from ..models import GDNConfig
from ..models.config import did_you_mean

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Every knob of ``gdn train`` (each also a config-file key)."""

    # model
    preset: str = "gdn"  #: GDNConfig preset (gdn, gdn-h1, gdn-h2, deltanet-transformer, qwen3next, transformer)
    size: str = "tiny"  #: GDNConfig size (tiny, 125m, 340m, 1.3b)
    model: dict = field(default_factory=dict)  #: GDNConfig overrides, e.g. {hidden_size: 256}
    # data
    data: str | None = None  #: None = the interpreter's stdlib *.py; a file/folder, .jsonl, .bin or hf:NAME
    tokenizer: str = "bytes"  #: "bytes" or a tokenizer.json from `gdn tokenizer train`
    text_field: str = "text"  #: text column of JSONL / datasets sources
    bin_dtype: str = "uint16"  #: id type of .bin memmaps
    eos_id: int | None = None  #: document separator id inside .bin memmaps
    val_fraction: float = 0.02  #: share of documents held out
    seq_len: int = 512  #: tokens per training window
    batch_size: int = 8  #: windows per optimizer step, over all ranks and micro-batches
    grad_accum: int = 1  #: micro-batches per optimizer step
    # optimisation
    steps: int = 1000  #: optimizer steps
    lr: float = 2e-3  #: peak learning rate
    min_lr_ratio: float = 0.1  #: final lr = lr * min_lr_ratio (cosine)
    warmup_steps: int = 100  #: linear warmup steps
    weight_decay: float = 0.1  #: AdamW decay (never on norms, biases, A_log, dt_bias)
    decay_embeddings: bool = True  #: apply weight decay to the embedding matrix
    beta1: float = 0.9  #: AdamW first-moment decay
    beta2: float = 0.95  #: AdamW second-moment decay
    adam_eps: float = 1e-8  #: AdamW epsilon
    grad_clip: float = 1.0  #: max global gradient norm (0 = off)
    max_bad_steps: int = 10  #: steps in a row with a non-finite loss or gradient norm (their updates skipped) before the run stops with a checkpoint
    # runtime
    seed: int = 0  #: seed of the initial weights and the data order
    device: str = "auto"  #: auto (cuda when available), cpu, cuda
    dtype: str = "auto"  #: auto (bf16 autocast on CUDA, fp32 on CPU), bf16, fp32
    compile: bool = False  #: torch.compile the model
    activation_checkpointing: bool = False  #: recompute blocks in the backward pass
    distributed: str = "ddp"  #: ddp or fsdp (FSDP2 fully_shard), used under torchrun
    context_parallel: int = 1  #: ranks splitting each packed row along T (torchrun; divides the ranks)
    context_parallel_attention: str = "gather"  #: global attention under context parallelism: gather (all keys on every rank) or ring (O(T / ranks) keys per rank)
    # logging, validation, checkpoints
    out: str = "runs/default"  #: run directory (config, metrics, checkpoints, plots)
    log_every: int = 10  #: steps between metric lines
    eval_every: int = 200  #: steps between validations (and at the end)
    eval_batches: int = 8  #: held-out packed rows per validation
    save_every: int = 500  #: steps between checkpoints (and at the end)
    keep_last: int = 3  #: checkpoints kept
    tensorboard: bool = True  #: also write TensorBoard events
    progress: bool = True  #: show a progress bar
    time_limit: float | None = None  #: stop (with a checkpoint) after this many seconds (of each run, resumed ones too)
    stop_after: int | None = None  #: stop (with a checkpoint) after this step: run a long schedule in pieces

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        pos = ("seq_len", "batch_size", "grad_accum", "steps", "log_every", "eval_every", "eval_batches",
               "save_every", "keep_last", "context_parallel", "max_bad_steps")
        for name in pos:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("lr", "weight_decay", "grad_clip", "min_lr_ratio", "adam_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:  # (NaN fails too)
                raise ValueError(f"{name} must be a finite non-negative number, got {v!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative int, got {self.warmup_steps!r}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of grad_accum ({self.grad_accum})")
        choices = {"device": ("auto", "cpu", "cuda"), "dtype": ("auto", "bf16", "fp32"), "distributed": ("ddp", "fsdp"),
                   "context_parallel_attention": ("gather", "ring")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.stop_after is not None and (not isinstance(self.stop_after, int) or self.stop_after < 1):
            raise ValueError(f"stop_after must be None or a positive int, got {self.stop_after!r}")
        t = self.time_limit
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise ValueError(f"time_limit must be None or a positive number of seconds, got {t!r}")
        if not isinstance(self.model, dict):
            raise ValueError(f"model must be a mapping of GDNConfig overrides, got {self.model!r}")
        GDNConfig.check_overrides(self.model)

    def to_dict(self) -> dict:
        """Plain dict (YAML/JSON serialisable)."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The config as YAML, in field order."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        """Write the resolved config as YAML (atomically)."""
        ckpt.atomic_write_text(path, self.to_yaml())


_FLOAT_KEYS = {"lr", "lrs", "min_lr_ratio", "weight_decay", "adam_eps", "grad_clip", "val_fraction", "beta1", "beta2",
               "alpha", "warmup_frac", "time_limit"}


def read_config_file(path: str | Path) -> dict:
    """A YAML or JSON config file -> dict."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {path} does not parse as JSON: line {e.lineno}, column {e.colno}: "
                         f"{e.msg}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} does not parse as YAML: {_yaml_problem(e)}") from None
    data = {k: _numbers(v) if k in _FLOAT_KEYS else v for k, v in data.items()} if isinstance(data, dict) else data
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of keys to values, got {type(data).__name__}")
    return data


def _yaml_problem(e: yaml.YAMLError) -> str:
    """``line L, column C: problem`` of a YAML error, on one line."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = " ".join(str(getattr(e, "problem", None) or e).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def _numbers(v):
    """YAML 1.1 reads ``3e-3`` as a string: turn number-looking strings (also inside lists) into floats."""
    if isinstance(v, list):
        return [_numbers(x) for x in v]
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def parse_set(items: list[str] | None) -> dict:
    """``["lr=1e-3", "model.hidden_size=256"]`` -> ``{"lr": 0.001, "model": {"hidden_size": 256}}``
    (values parsed as YAML scalars)."""
    out: dict = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            value = _numbers(yaml.safe_load(raw)) if raw else None
        except yaml.YAMLError as e:
            raise ValueError(f"--set {item}: the value does not parse as YAML ({_yaml_problem(e)})") from None
        parts = key.strip().split(".")
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = value
    return out


def merge(base: dict, update: dict) -> dict:
    """Recursive dict update (``model`` overrides merge key by key)."""
    out = dict(base)
    for k, v in update.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _given(file, flags, sets) -> dict:
    """What a command line sets: config file, then explicit flags (``None`` ignored), then ``--set`` items."""
    data = read_config_file(file) if file else {}
    data = merge(data, {k: v for k, v in (flags or {}).items() if v is not None})
    return merge(data, parse_set(sets))


#: Other training tools' names for these keys, for the "did you mean" of an unknown key (spelling
#: alone would point ``ckpt_every`` at ``log_every``).
_SYNONYMS = {
    "learning_rate": "lr", "max_steps": "steps", "num_steps": "steps", "train_steps": "steps",
    "ckpt_every": "save_every", "checkpoint_every": "save_every", "save_steps": "save_every",
    "save_interval": "save_every", "log_interval": "log_every", "logging_steps": "log_every",
    "eval_interval": "eval_every", "eval_steps": "eval_every", "warmup": "warmup_steps",
    "batch": "batch_size", "micro_batch_size": "batch_size", "gradient_accumulation_steps": "grad_accum",
    "max_grad_norm": "grad_clip", "clip_grad": "grad_clip", "context_length": "seq_len",
    "max_seq_len": "seq_len", "block_size": "seq_len", "output_dir": "out", "wd": "weight_decay",
}


def _make(cls, data: dict):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}{did_you_mean(unknown, sorted(names), _SYNONYMS)}; "
                         f"valid keys: {sorted(names)}")
    return cls(**data)


def build_config(file: str | Path | None = None, flags: dict | None = None, sets: list[str] | None = None,
                 cls=TrainConfig):
    """Config file, then explicit flags (``None`` values ignored), then ``--set`` items."""
    return _make(cls, _given(file, flags, sets))


def read_saved_config(path: str | Path) -> dict:
    """A run's saved ``config.yaml`` / ``train_config.yaml`` as a dict. Lenient: keys this version
    does not know (the file was written by a newer one, or before model keys were checked) are
    dropped with a warning."""
    path = Path(path)
    data = read_config_file(path)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    dropped = sorted(set(data) - names)
    if isinstance(data.get("model"), dict):
        valid = set(GDNConfig.field_names())
        dropped += [f"model.{k}" for k in sorted(map(str, set(data["model"]) - valid))]
        data["model"] = {k: v for k, v in data["model"].items() if k in valid}
    if dropped:
        logger.warning("%s: ignoring keys this version does not know: %s", path, ", ".join(dropped))
    return {k: v for k, v in data.items() if k in names}


def resume_config(resume: bool | str | Path, file: str | Path | None = None, flags: dict | None = None,
                  sets: list[str] | None = None) -> TrainConfig:
    """The config of a resumed run (``gdn train --resume``): the settings saved in the checkpoint it
    continues from, then what the command line gives now (config file, flags, ``--set``, as in
    :func:`build_config`), so that only what is given changes.

    ``resume``: True (the newest checkpoint under ``out``) or a checkpoint / run folder. Without an
    ``out`` given now, the run folder is the one that holds the checkpoint (or, for ``True``, the
    default). A ``stop_after`` the checkpoint has reached is dropped unless given again: kept, it
    would stop the resumed run after one step. The checkpoint is verified by the :class:`Trainer`;
    here only its ``train_config.yaml`` is read."""
    given = _given(file, flags, sets)
    out = given.get("out")
    if out is None and (resume is True or resume == "latest"):
        out = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "out")
    path = ckpt.locate(resume, out if out is not None else ".")
    try:
        saved = read_saved_config(path / "train_config.yaml")
    except ValueError:
        ckpt.verify(path)  # a damaged checkpoint is reported as one
        raise
    if out is None:
        run = ckpt.run_of(path)
        out = str(run) if run is not None else saved.get("out")
    step = ckpt.step_of(path)
    if "stop_after" not in given and saved.get("stop_after") is not None and step is not None \
            and saved["stop_after"] <= step:
        saved["stop_after"] = None
    data = merge(saved, given)
    if out is not None:
        data["out"] = str(out)
    return _make(TrainConfig, data)


def _show(v) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def changed_settings(before: dict, after: dict) -> list[str]:
    """``["steps 40 -> 60", "model.hidden_size 32 -> 64"]``: the keys of ``after`` whose values differ
    from ``before`` (``model`` key by key, ``(unset)`` for a key one side lacks; ``out`` compared as
    resolved paths)."""
    out = []
    for key, new in after.items():
        old = before.get(key)
        if key == "model" and isinstance(new, dict) and isinstance(old, dict):
            for k in sorted(set(old) | set(new), key=str):
                if k not in old or k not in new or old[k] != new[k]:
                    out.append(f"model.{k} {_show(old[k]) if k in old else '(unset)'} -> "
                               f"{_show(new[k]) if k in new else '(unset)'}")
        elif key == "out" and old is not None and new is not None:
            if Path(old).resolve() != Path(new).resolve():
                out.append(f"out {_show(old)} -> {_show(new)}")
        elif key not in before:
            out.append(f"{key} (unset) -> {_show(new)}")
        elif old != new:
            out.append(f"{key} {_show(old)} -> {_show(new)}")
    return out


def describe_keys() -> list[tuple[str, str, str, str]]:
    """``(key, type, default, help)`` of every :class:`TrainConfig` key, in declaration order; the
    help is the field's ``#:`` comment in this module's source (what ``gdn train --list-keys``
    prints)."""
    import inspect
    import re

    notes = {}
    for line in inspect.getsource(TrainConfig).splitlines():
        m = re.match(r"\s+(\w+): .*?#: (.*)$", line)
        if m:
            notes[m.group(1)] = m.group(2).strip()
    rows = []
    for f in dataclasses.fields(TrainConfig):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append((f.name, kind, repr(default), notes.get(f.name, "")))
    return rows
