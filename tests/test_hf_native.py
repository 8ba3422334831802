"""Checkpoints written by ``gdn train`` are transformers-native: ``AutoTokenizer`` and
``pipeline("text-generation")`` load them after ``import gdn``, the tokenizer gives gdn's own ids,
the special token ids sit in ``config.json`` / ``generation_config.json``, and plain transformers
(no ``import gdn``) either says to pass ``trust_remote_code=True`` or, with it, loads the model
through the checkpoint's ``modeling_gdn.py``."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

import gdn  # noqa: F401  (registers model_type "gdn" with the Auto classes)
from gdn.checkpoint import verify
from gdn.cli import main
from gdn.data import BPETokenizer, ByteTokenizer, load_tokenizer, train_bpe

transformers = pytest.importorskip("transformers")

TINY = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.head_dim=16", "model.intermediate_size=64",
        "seq_len=32", "batch_size=2", "eval_every=3", "eval_batches=1", "save_every=3", "tensorboard=false",
        "progress=false", "val_fraction=0.25", "warmup_steps=1"]

#: Texts whose round trip is easy to get wrong: the byte 0xFF's Latin-1 look-alike, the special
#: token's own spelling, control bytes, spaces at either end, multi-byte scripts and emoji.
TEXTS = ["def f(a):\n    return a + 1\n", "ÿ", "a ÿ b", "<|endoftext|>", "x<|endoftext|>y", "\x00\x01\x1f \t\r\n",
         "  lead", "trail  ", "Ġ Ā ĉ", "日本語 🤗 é", "", "\u00ad\u00a0"]


def _random_texts(n=200, seed=0):
    rng = random.Random(seed)

    def char():
        lo, hi = rng.choice([(0, 0x80), (0x80, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x110000)])
        return chr(rng.randrange(lo, hi))

    return ["".join(char() for _ in range(rng.randrange(0, 30))) for _ in range(n)]


def _train(tmp, extra=()):
    data = tmp / "data"
    data.mkdir()
    for i in range(8):
        (data / f"m{i}.py").write_text(f"import os\n\ndef g{i}(a):\n    return a + {i}\n" * (4 + i))
    args = ["train", "--data", str(data), "--steps", "1", "--out", str(tmp / "run")]
    for s in [*TINY, *extra]:
        args += ["--set", s]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)
    (ckpt,) = (tmp / "run" / "checkpoints").iterdir()
    return ckpt


@pytest.fixture(scope="module")
def byte_ckpt(tmp_path_factory):
    """A checkpoint of a one-step byte-level run (vocabulary 256)."""
    return _train(tmp_path_factory.mktemp("bytes"))


@pytest.fixture(scope="module")
def bpe_ckpt(tmp_path_factory):
    """A checkpoint of a one-step run with a 300-id BPE fitted by ``gdn tokenizer train``."""
    tmp = tmp_path_factory.mktemp("bpe")
    texts = [f"import os\n\ndef g{i}(a):\n    return a + {i}\n" * 6 for i in range(20)]
    train_bpe(texts, 300, out=tmp / "tok.json")
    return _train(tmp, [f"tokenizer={tmp / 'tok.json'}", "seq_len=16"])


# --------------------------------------------------------------------------------- the byte tokenizer

def test_byte_checkpoint_files_carry_special_ids_and_auto_map(byte_ckpt):
    cfg = json.loads((byte_ckpt / "config.json").read_text())
    gen = json.loads((byte_ckpt / "generation_config.json").read_text())
    assert cfg["vocab_size"] == 256
    for d in (cfg, gen):
        assert (d["bos_token_id"], d["eos_token_id"], d["pad_token_id"]) == (255, 255, 255)
    assert cfg["auto_map"] == {"AutoConfig": "modeling_gdn.GDNConfig", "AutoModel": "modeling_gdn.GDNModel",
                               "AutoModelForCausalLM": "modeling_gdn.GDNForCausalLM"}
    tc = json.loads((byte_ckpt / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast" and tc["eos_token"] == "<|endoftext|>"
    assert json.loads((byte_ckpt / "special_tokens_map.json").read_text())["bos_token"] == "<|endoftext|>"
    verify(byte_ckpt)  # the new files are in the manifest
    manifest = json.loads((byte_ckpt / "manifest.json").read_text())["files"]
    assert {"tokenizer_config.json", "generation_config.json", "modeling_gdn.py"} <= set(manifest)


def test_autotokenizer_gives_the_byte_ids(byte_ckpt):
    tok = transformers.AutoTokenizer.from_pretrained(byte_ckpt)
    ours = load_tokenizer(byte_ckpt)
    assert isinstance(ours, ByteTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == (255, 255, 255, 256)
    for text in TEXTS + _random_texts():
        ids = tok(text)["input_ids"]
        assert ids == list(text.encode("utf-8")) == ours.encode(text), text
        assert tok.decode(ids) == text == ours.decode(ids), text


def test_autotokenizer_decodes_invalid_utf8_like_gdn(byte_ckpt):
    """Any byte sequence without the special id decodes to what gdn's decode (errors="replace") gives."""
    tok = transformers.AutoTokenizer.from_pretrained(byte_ckpt)
    ours, rng = ByteTokenizer(), random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(255) for _ in range(rng.randrange(1, 12))]
        assert tok.decode(ids) == ours.decode(ids), ids
    assert tok.decode([104, 255, 105], skip_special_tokens=True) == "hi"


def test_saved_byte_tokenizer_is_a_tokenizers_file(tmp_path):
    from tokenizers import Tokenizer

    ByteTokenizer().save(tmp_path)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert raw.get_vocab_size() == 256 and raw.token_to_id("<|endoftext|>") == 255
    for text in TEXTS + _random_texts(50):
        if "<|endoftext|>" not in text:  # only transformers knows split_special_tokens
            assert raw.encode(text).ids == list(text.encode("utf-8")), text
    assert raw.decode(list("Grüße 🤗".encode())) == "Grüße 🤗"


def test_load_tokenizer_reads_old_and_new_files(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "tokenizer.json").write_text(json.dumps({"kind": "bytes"}))
    assert isinstance(load_tokenizer(tmp_path / "old"), ByteTokenizer)
    ByteTokenizer().save(tmp_path / "new")
    assert isinstance(load_tokenizer(tmp_path / "new" / "tokenizer.json"), ByteTokenizer)
    bpe = train_bpe(["hello world, hello gdn " * 20, "more text here"], 270)
    bpe.save(tmp_path / "bpe")
    again = load_tokenizer(tmp_path / "bpe")
    assert isinstance(again, BPETokenizer) and again.eos_id == bpe.eos_id
    for text in ("hello gdn", "hello<|endoftext|>world", "ÿ"):
        assert again.encode(text) == bpe.encode(text)


# ---------------------------------------------------------------------------------- the BPE tokenizer

def test_bpe_checkpoint_autotokenizer_matches_gdn(bpe_ckpt):
    tok = transformers.AutoTokenizer.from_pretrained(bpe_ckpt)
    ours = load_tokenizer(bpe_ckpt)
    assert isinstance(ours, BPETokenizer) and tok.eos_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == ours.eos_id
    cfg = json.loads((bpe_ckpt / "config.json").read_text())
    gen = json.loads((bpe_ckpt / "generation_config.json").read_text())
    assert cfg["eos_token_id"] == gen["eos_token_id"] == ours.eos_id
    for text in TEXTS + _random_texts(100):
        ids = tok(text)["input_ids"]
        assert ids == ours.encode(text), text
        assert tok.decode(ids, skip_special_tokens=True) == ours.decode(ids), text


# ---------------------------------------------------------------------------------------- pipelines

@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_text_generation_pipeline(which, request):
    ckpt = request.getfixturevalue(f"{'byte' if which == 'bytes' else 'bpe'}_ckpt")
    pipe = transformers.pipeline("text-generation", model=str(ckpt), device="cpu")
    out = pipe("def g", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    ids = torch.tensor([tok("def g")["input_ids"]])
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out == "def g" + tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)


# ------------------------------------------------------------------------ without ``import gdn``

def _plain_python(code, tmp_path, block_gdn=False):
    """Run ``code`` in a fresh interpreter that has not imported gdn (``block_gdn``: cannot)."""
    pre = "import sys; sys.modules['gdn'] = None\n" if block_gdn else ""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([sys.executable, "-c", pre + code], capture_output=True, text=True, timeout=300, env=env,
                          stdin=subprocess.DEVNULL)


def test_plain_transformers_asks_for_trust_remote_code_then_loads(byte_ckpt, tmp_path):
    code = f"""
import sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
ckpt = {str(byte_ckpt)!r}
try:
    AutoModelForCausalLM.from_pretrained(ckpt)
except ValueError as e:
    print("REFUSED", "trust_remote_code=True" in str(e), "gdn" in sys.modules)
tok = AutoTokenizer.from_pretrained(ckpt)
print("TOKENIZER", "gdn" in sys.modules, tok("hé")["input_ids"])
model = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
print("LOADED", type(model).__module__, type(model).__name__)
with torch.no_grad():
    print("LOGITS", model(torch.tensor([[100, 101, 102]])).logits.sum().item())
"""
    res = _plain_python(code, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    # (transformers' "run the custom code? [y/N]" prompt, answered by the closed stdin, shares lines)
    lines = {k: re.search(rf"{k} (.*)", res.stdout).group(1) for k in ("REFUSED", "TOKENIZER", "LOADED", "LOGITS")}
    assert lines["REFUSED"] == "True False"
    assert lines["TOKENIZER"] == "False [104, 195, 169]"
    assert lines["LOADED"] == "gdn.models.modeling GDNForCausalLM"
    model = transformers.AutoModelForCausalLM.from_pretrained(byte_ckpt).eval()
    with torch.no_grad():
        ref = model(torch.tensor([[100, 101, 102]])).logits.sum().item()
    assert float(lines["LOGITS"]) == pytest.approx(ref, rel=1e-5, abs=1e-5)


def test_remote_code_file_is_imports_only_and_says_when_gdn_is_missing(byte_ckpt, tmp_path):
    import ast

    tree = ast.parse((byte_ckpt / "modeling_gdn.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Lambda))]
    code = f"""
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained({str(byte_ckpt)!r}, trust_remote_code=True)
except ImportError as e:
    print("MISSING", str(e).splitlines()[0])
"""
    res = _plain_python(code, tmp_path, block_gdn=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("MISSING "), res.stdout
    assert "gdn" in res.stdout and "install" in res.stdout


def test_a_remote_code_model_saves_a_transformers_native_folder(byte_ckpt, tmp_path):
    """Loaded with trust_remote_code and no ``import gdn``, then saved with ``save_pretrained``: the
    folder gets ``modeling_gdn.py`` and its ``auto_map`` (not a copy of gdn's sources) and loads again."""
    out = tmp_path / "resaved"
    code = f"""
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(byte_ckpt)!r}, trust_remote_code=True)
model.save_pretrained({str(out)!r})
again = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
print("SAVED", type(again).__name__)
"""
    res = _plain_python(code, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "SAVED GDNForCausalLM" in res.stdout
    assert sorted(p.name for p in out.glob("*.py")) == ["modeling_gdn.py"]
    assert json.loads((out / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == \
        "modeling_gdn.GDNForCausalLM"


def test_save_pretrained_of_a_new_model_is_transformers_native(tmp_path):
    from gdn.models import GDNConfig, GDNForCausalLM

    model = GDNForCausalLM(GDNConfig.from_preset("gdn", "tiny", hidden_size=32, num_hidden_layers=1, head_dim=16,
                                                 intermediate_size=64))
    model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "modeling_gdn.py").exists()
    assert "auto_map" in json.loads((tmp_path / "m" / "config.json").read_text())
    assert getattr(model.config, "auto_map", None) is None  # the model's own config is left as it was
