"""Qwen3.5 / Qwen3-Next checkpoints to gdn and back: same logits, same greedy generations; a converted
folder loads with the ordinary ``from_pretrained`` (the gated attention is part of gdn's own layers)."""
from __future__ import annotations

import json

import pytest
import torch

import gdn  # noqa: F401  (registers the gdn model type with the Auto classes)
from gdn.compat import convert
from gdn.layers import Attention
from gdn.models import GDNConfig, GDNForCausalLM

from .tiny import qwen3_5_config, qwen3_next_config, randomize, rel

transformers = pytest.importorskip("transformers")

FAMILIES = {
    "hf-qwen3.5": ("Qwen3_5ForCausalLM", qwen3_5_config),
    "hf-qwen3-next": ("Qwen3NextForCausalLM", qwen3_next_config),
}


def _hf_model(family, **over):
    cls_name, make = FAMILIES[family]
    torch.manual_seed(0)
    return randomize(getattr(transformers, cls_name)(make(**over)), seed=3, std=0.3).eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_logits_and_generation(family, tmp_path):
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path / "src")
    assert convert.convert(family, tmp_path / "src", tmp_path / "gdn") == "to-gdn"
    assert json.loads((tmp_path / "gdn" / "config.json").read_text())["model_type"] == "gdn"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gdn", output_loading_info=True)
    model.eval()
    assert type(model) is GDNForCausalLM and not info["missing_keys"] and not info["unexpected_keys"]
    attn = [b.mixer for b in model.model.layers if isinstance(b.mixer, Attention)]
    assert len(attn) == 1 and attn[0].output_gate and attn[0].qk_norm and attn[0].rotary_dim == 4
    ids = torch.randint(3, 96, (2, 23), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = hf(ids).logits
        assert rel(model(ids).logits, ref) < 1e-4
        assert torch.equal(model.generate(ids, **kw), hf.generate(ids, **kw))

    assert convert.convert(family, tmp_path / "gdn", tmp_path / "back") == "to-hf"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == FAMILIES[family][0]
    with torch.no_grad():
        assert rel(back(ids).logits, ref) < 1e-4
    orig = hf.state_dict()
    for name, t in back.state_dict().items():
        assert torch.allclose(t, orig[name], atol=1e-6), name


def test_tied_embeddings_and_dtype_cast(tmp_path):
    hf = _hf_model("hf-qwen3.5", tie_word_embeddings=True)
    hf.save_pretrained(tmp_path / "src")
    convert.main(["hf-qwen3.5", str(tmp_path / "src"), str(tmp_path / "gdn")])
    model = convert.load_gdn(tmp_path / "gdn")
    assert not model.training and model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(3, 96, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(model(ids).logits, hf(ids).logits) < 1e-4
    convert.main(["hf-qwen3.5", str(tmp_path / "src"), str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    sd = convert.load_state_dict(tmp_path / "bf16")
    assert sd["model.layers.0.mixer.q_proj.weight"].dtype == torch.bfloat16
    assert sd["model.layers.0.mixer_norm.weight"].dtype == torch.float32  # 1 + w kept exact


def test_gdn_cache_decode_matches_one_pass(tmp_path):
    """The converted model's cached decode (gated attention KV state + recurrent state) equals one pass."""
    hf = _hf_model("hf-qwen3-next")
    hf.save_pretrained(tmp_path / "src")
    convert.convert("hf-qwen3-next", tmp_path / "src", tmp_path / "gdn")
    model = GDNForCausalLM.from_pretrained(tmp_path / "gdn").eval()
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :7], use_cache=True)
        cache, steps = out.get("cache", out.get("past_key_values")), [out.logits]
        for t in range(7, 12):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
    assert rel(torch.cat(steps, 1), full) < 1e-5


def test_subparser_hooks_into_a_cli():
    import argparse

    parser = argparse.ArgumentParser(prog="gdn")
    convert.add_subparser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["convert", "hf-qwen3-next", "a", "b", "--dtype", "bfloat16"])
    assert (args.command, args.family, args.src, args.dst, args.dtype) == ("convert", "hf-qwen3-next", "a", "b",
                                                                           "bfloat16")
    assert args.func is convert.run_from_args
    with pytest.raises(SystemExit):
        parser.parse_args(["convert", "hf-llama", "a", "b"])


def test_refusals(tmp_path):
    moe = transformers.Qwen3NextConfig(**{**qwen3_next_config().to_dict(), "num_experts": 4})
    with pytest.raises(ValueError, match="mixture-of-experts"):
        convert.hf_config_to_gdn(moe, "hf-qwen3-next")
    with pytest.raises(ValueError, match="not hf-qwen3.5"):
        convert.hf_config_to_gdn(qwen3_next_config(), "hf-qwen3.5")
    plain = GDNConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, layer_pattern="GA", num_heads=2,
                      head_dim=8, num_attention_heads=4, intermediate_size=48)
    with pytest.raises(ValueError, match="attention_output_gate"):
        convert.gdn_config_to_hf(plain, "hf-qwen3.5")
    with pytest.raises(ValueError, match="layer_pattern"):
        convert.gdn_config_to_hf(GDNConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, layer_pattern="GD",
                                           num_heads=2, head_dim=8, intermediate_size=48), "hf-qwen3.5")
    with pytest.raises(ValueError, match="family"):
        convert.convert("hf-llama", tmp_path, tmp_path / "x")
    with pytest.raises(ValueError, match="config.json"):
        convert.convert("hf-qwen3.5", tmp_path, tmp_path / "x")


def test_multimodal_qwen3_5_checkpoint_text_part(tmp_path):
    """Published Qwen3.5 checkpoints are image-text models: the language model converts, the vision
    tower is left out, and text logits agree."""
    cfg = transformers.Qwen3_5Config(
        text_config=qwen3_5_config().to_dict(),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3))
    torch.manual_seed(0)
    hf = randomize(transformers.Qwen3_5ForConditionalGeneration(cfg), seed=3, std=0.3).eval()
    hf.save_pretrained(tmp_path / "src")
    convert.convert("hf-qwen3.5", tmp_path / "src", tmp_path / "gdn")
    model = GDNForCausalLM.from_pretrained(tmp_path / "gdn").eval()
    ids = torch.randint(3, 96, (2, 15), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel(model(ids).logits, hf(input_ids=ids).logits) < 1e-4


# ------------------------------------------------------------------- checkpoints gdn itself writes

def _gdn_folder(path, with_tokenizer=True):
    """A tiny all-Gated-DeltaNet gdn model saved the plain way (``save_pretrained``; no token ids in
    its config, as in checkpoints written before gdn recorded them) plus the byte tokenizer."""
    from gdn.data import ByteTokenizer

    torch.manual_seed(0)
    cfg = GDNConfig.from_preset("gdn", "tiny", hidden_size=32, num_hidden_layers=2, head_dim=16, intermediate_size=64)
    model = randomize(GDNForCausalLM(cfg), seed=1, std=0.3).eval()
    model.save_pretrained(path)
    if with_tokenizer:
        ByteTokenizer().save(path)
    return model


def test_gdn_saved_model_without_token_ids_converts(tmp_path):
    model = _gdn_folder(tmp_path / "src")
    assert "bos_token_id" not in json.loads((tmp_path / "src" / "config.json").read_text())
    assert convert.convert("hf-qwen3-next", tmp_path / "src", tmp_path / "out") == "to-hf"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "Qwen3NextForCausalLM"
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # use_cache=False: transformers' cache for Qwen3-Next needs an attention layer, and these have none
        assert rel(hf(ids, use_cache=False).logits, model(ids).logits) < 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok("hé")["input_ids"] == [104, 195, 169]


def test_trained_checkpoint_converts_with_its_token_ids(tmp_path):
    """The checkpoint of a `gdn train` run converts (its config now carries the tokenizer's ids),
    and the converted folder keeps them and the tokenizer but not gdn's remote-code file."""
    from gdn.cli import main

    (tmp_path / "data").mkdir()
    for i in range(4):
        (tmp_path / "data" / f"m{i}.py").write_text(f"def g{i}(a):\n    return a + {i}\n" * 12)
    args = ["train", "--data", str(tmp_path / "data"), "--steps", "1", "--out", str(tmp_path / "run")]
    for s in ("model.hidden_size=32", "model.num_hidden_layers=2", "model.head_dim=16", "model.intermediate_size=64",
              "seq_len=32", "batch_size=2", "eval_batches=1", "tensorboard=false", "progress=false",
              "val_fraction=0.25", "warmup_steps=1"):
        args += ["--set", s]
    assert main(args) == 0
    (ckpt,) = (tmp_path / "run" / "checkpoints").iterdir()
    assert main(["convert", "hf-qwen3-next", str(ckpt), str(tmp_path / "out")]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (cfg["model_type"], cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (
        "qwen3_next", 255, 255, 255)
    assert "auto_map" not in cfg and not (tmp_path / "out" / "modeling_gdn.py").exists()
    gdn_model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 255, (1, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(hf(ids, use_cache=False).logits, gdn_model(ids).logits) < 1e-4
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").eos_token_id == 255


def _run_gdn(*args, cwd):
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("gdn")
    if not exe.exists():
        pytest.skip("the gdn console script is not installed next to this interpreter")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})


def test_cli_refuses_to_overwrite_a_destination_unless_forced(tmp_path):
    _gdn_folder(tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    res = _run_gdn("convert", "hf-qwen3-next", "src", "out", cwd=tmp_path)
    err = res.stderr.strip()
    assert res.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, (res.returncode, err)
    assert "out" in err and "--force" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["keep.txt"]

    res = _run_gdn("convert", "hf-qwen3-next", "src", "out", "--force", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not (tmp_path / "out" / "keep.txt").exists()  # DST replaced, not merged into
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3_next"


def test_convert_refuses_a_destination_that_holds_the_source(tmp_path):
    _gdn_folder(tmp_path / "work" / "src", with_tokenizer=False)
    with pytest.raises(ValueError, match="inside DST"):
        convert.convert("hf-qwen3-next", tmp_path / "work" / "src", tmp_path / "work", force=True)
    assert (tmp_path / "work" / "src" / "model.safetensors").exists()
