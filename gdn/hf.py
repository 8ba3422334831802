"""The files that make a gdn model folder transformers-native, and :func:`save_for_transformers`,
which writes them (checkpoints of ``gdn train`` and folders of ``gdn convert … to gdn``).

A folder it writes holds, besides the weights:

- ``config.json``: the :class:`gdn.models.GDNConfig` with the tokenizer's ``bos_token_id``,
  ``eos_token_id`` and ``pad_token_id`` and an ``auto_map`` naming the classes in
  ``modeling_gdn.py`` (:data:`AUTO_MAP`);
- ``generation_config.json``: the same three ids, which ``generate`` and pipelines read;
- ``modeling_gdn.py`` (:data:`REMOTE_CODE`): no model code, only an import of the installed gdn
  package's classes, and an ``ImportError`` saying to install gdn where it is missing;
- the tokenizer's files (``tokenizer.json``, ``tokenizer_config.json``,
  ``special_tokens_map.json``; :mod:`gdn.data.tokenizer` says what they hold).

So after ``import gdn``, ``AutoTokenizer``, ``AutoModelForCausalLM`` and
``pipeline("text-generation", model=folder)`` load the folder (the registered local classes win
over the ``auto_map``). Without ``import gdn``, transformers finds model type ``gdn`` unknown,
sees the ``auto_map`` and refuses with a message asking for ``trust_remote_code=True``; with it,
transformers copies ``modeling_gdn.py`` into its module cache and imports it, which imports gdn
(which registers the ``gdn`` type) and hands over its classes.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

#: ``config.json``'s ``auto_map``: the Auto classes -> ``modeling_gdn.py``'s names.
AUTO_MAP = {"AutoConfig": "modeling_gdn.GDNConfig", "AutoModel": "modeling_gdn.GDNModel",
            "AutoModelForCausalLM": "modeling_gdn.GDNForCausalLM"}
#: File name of :data:`REMOTE_CODE` in a saved folder (the module part of :data:`AUTO_MAP`).
REMOTE_CODE_FILE = "modeling_gdn.py"
#: The text of ``modeling_gdn.py``. The import sits in ``try``, where transformers' check of a
#: remote module's imports does not look, so a missing gdn reaches this message, not a generic one.
REMOTE_CODE = '''"""transformers' remote-code entry point of a gdn model folder (written by gdn).

config.json's auto_map names the classes below, so that
AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True) works in a program that has
not imported gdn. The model code is the installed gdn package's; this file only imports it.
After `import gdn` transformers uses those classes directly, and this file is not read.
"""
try:
    from gdn.models import GDNConfig, GDNForCausalLM, GDNModel
except ImportError as e:
    raise ImportError(
        "this folder holds a gdn model (Gated DeltaNet); its code is the gdn Python package, which "
        "could not be imported here: install gdn (pip install . in a clone of its repository) in this "
        f"environment, then load the folder again (cause: {e})"
    ) from e

__all__ = ["GDNConfig", "GDNModel", "GDNForCausalLM"]
'''

#: The token-id fields a tokenizer's ``special_token_ids`` may set.
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_remote_code(directory: str | Path) -> None:
    """Write ``modeling_gdn.py`` (:data:`REMOTE_CODE`) into ``directory``."""
    _write(Path(directory) / REMOTE_CODE_FILE, REMOTE_CODE)


def save_for_transformers(directory: str | Path, config, tokenizer=None) -> None:
    """Write ``config.json``, ``generation_config.json``, ``modeling_gdn.py`` and (when given) the
    tokenizer's files into ``directory`` (created).

    Args:
        config: a :class:`gdn.models.GDNConfig`; not modified (a copy gets the ids and ``auto_map``).
        tokenizer: a gdn tokenizer (:mod:`gdn.data.tokenizer`); its ``special_token_ids`` become
            the config's bos/eos/pad ids. Without one, the config's own ids (if any) are kept.

    Raises ``ValueError`` when a special id does not fit the model's vocabulary.
    """
    from transformers import GenerationConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    ids = dict(getattr(tokenizer, "special_token_ids", None) or {})
    for name, value in ids.items():
        if name not in TOKEN_ID_FIELDS:
            raise ValueError(f"the tokenizer's special_token_ids has {name!r}; expected only {TOKEN_ID_FIELDS}")
        if value is not None and not 0 <= value < config.vocab_size:
            raise ValueError(f"the tokenizer's {name} is {value}, outside the model's vocabulary of "
                             f"{config.vocab_size}; give the model a vocab_size above it")
        setattr(config, name, value)
    config.auto_map = dict(AUTO_MAP)
    # to_json_file, not save_pretrained: after a trust_remote_code load transformers marks the
    # config class for custom_object_save, which would copy gdn's sources here and rewrite auto_map.
    config.to_json_file(str(directory / "config.json"))
    gen = {name: getattr(config, name, None) for name in TOKEN_ID_FIELDS}
    GenerationConfig(**{k: v for k, v in gen.items() if v is not None}).to_json_file(
        str(directory / "generation_config.json"))
    write_remote_code(directory)
    if tokenizer is not None:
        tokenizer.save(directory)

