"""The `gdn` command line: help of every subcommand, config precedence, and each command end to end
on tiny inputs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from gdn.cli import build_parser, main
from gdn.train import TrainConfig, build_config

SUBCOMMANDS = ["train", "generate", "eval", "mqar", "bench", "tokenizer", "demo", "convert"]
TINY = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.head_dim=16", "model.intermediate_size=64",
        "seq_len=32", "batch_size=2", "eval_every=3", "eval_batches=1", "save_every=3", "tensorboard=false",
        "progress=false", "val_fraction=0.25", "warmup_steps=1"]


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    for i in range(8):
        (d / f"m{i}.py").write_text(f"import os\n\ndef g{i}(a):\n    return a + {i}\n" * (4 + i))
    return d


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_every_subcommand_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: gdn " + cmd in out
    # each option states its default once (the formatter adds it unless the help text has it)
    options = " ".join(out.split()).split(" --")
    assert all(o.count("(default:") <= 1 for o in options), out


def test_train_help_lists_every_flag():
    helptext = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for flag in ("--config", "--preset", "--size", "--data", "--steps", "--out", "--resume", "--set"):
        assert flag in helptext


def test_config_precedence_and_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"lr": 1e-3, "steps": 50, "model": {"hidden_size": 64, "num_heads": 2}}))
    cfg = build_config(f, {"steps": 70, "out": None}, ["lr=3e-4", "model.hidden_size=96", "data=null"])
    assert (cfg.lr, cfg.steps, cfg.data) == (3e-4, 70, None)
    assert cfg.model == {"hidden_size": 96, "num_heads": 2}
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"seq_len": 128}))
    assert build_config(j).seq_len == 128
    with pytest.raises(ValueError, match="unknown config keys"):
        build_config(None, None, ["learning_rate=1"])
    with pytest.raises(ValueError, match=r"\['ckpt_every'\] \(did you mean save_every\?\)"):
        build_config(None, None, ["ckpt_every=10"])
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="key=value"):
        build_config(None, None, ["lr"])
    with pytest.raises(ValueError, match="distributed"):
        TrainConfig(distributed="horovod")


def test_train_generate_eval_end_to_end(tmp_path, corpus, capsys):
    cfgfile = tmp_path / "run.yaml"
    cfgfile.write_text(yaml.safe_dump({"lr": 0.003, "log_every": 1}))
    out = tmp_path / "run"
    args = ["train", "--config", str(cfgfile), "--data", str(corpus), "--steps", "3", "--out", str(out)]
    for s in TINY:
        args += ["--set", s]
    assert main(args) == 0
    assert "bits/byte" in capsys.readouterr().out
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["lr"] == 0.003 and saved["steps"] == 3 and saved["model"]["hidden_size"] == 32
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert main(["generate", "--ckpt", str(out), "--prompt", "def ", "--max-new-tokens", "12", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["eval", "--ckpt", str(out), "--batches", "1", "--batch-size", "2", "--device", "cpu"]) == 0
    assert "bits/byte" in capsys.readouterr().out
    # the checkpoint may be given as the command's argument instead of --ckpt
    assert main(["eval", str(out), "--batches", "1", "--batch-size", "2", "--device", "cpu"]) == 0
    assert "bits/byte" in capsys.readouterr().out
    assert main(["generate", str(out), "--prompt", "def ", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    # a corrupted checkpoint is reported, not loaded
    (next((out / "checkpoints").iterdir()) / "model.safetensors").write_bytes(b"garbage")
    assert main(["generate", "--ckpt", str(out), "--device", "cpu"]) == 3
    assert "checkpoint error" in capsys.readouterr().err


def test_bad_option_is_an_error_message(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), "--set", "steps=-1"]) == 2
    assert "steps must be a positive int" in capsys.readouterr().err


def test_tokenizer_train_and_bpe_training(tmp_path, corpus, capsys):
    tokf = tmp_path / "tok.json"
    assert main(["tokenizer", "train", "--data", str(corpus), "--vocab-size", "300", "--out", str(tokf)]) == 0
    args = ["train", "--data", str(corpus), "--steps", "1", "--out", str(tmp_path / "bpe"),
            "--set", f"tokenizer={tokf}", "--set", "seq_len=16"]
    for s in TINY[:4] + TINY[5:]:
        args += ["--set", s]
    assert main(args) == 0
    cfg = json.loads((tmp_path / "bpe/model_config.json").read_text())
    assert 256 < cfg["vocab_size"] <= 300


def test_mqar_command(tmp_path, capsys):
    sets = ["mixers=GA", "widths=[16]", "num_pairs=[2]", "lrs=[0.003]", "seq_len=16", "vocab_size=16",
            "train_examples=64", "test_examples=32", "batch_size=32", "workers=1"]
    args = ["mqar", "--out", str(tmp_path)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Gated DeltaNet (G)" in out and "softmax attention (A)" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results) == 2 and all(0 <= r["accuracy"] <= 1 for r in results)
    assert (tmp_path / "mqar.png").exists()


def test_bench_prints_the_op_table(capsys):
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines()[2:] if ln.strip()]
    ops_seen = {r[0] for r in rows}
    assert {"linear_attention", "gated_linear_attention", "delta_rule", "gated_delta_rule", "kimi_delta_attention",
            "softmax_attention"} <= ops_seen, out
    assert all(float(r[2]) < 1e-4 for r in rows), out  # every backend agrees with the naive recurrence


def test_convert_is_a_gdn_subcommand(tmp_path):
    """``gdn convert`` reaches gdn.compat.convert (a source that is no model folder is refused)."""
    args = build_parser().parse_args(["convert", "hf-qwen3.5", str(tmp_path), str(tmp_path / "out")])
    with pytest.raises((ValueError, OSError)):
        args.func(args)


def test_generate_graph_more_prompts_than_slots_in_the_real_script(tmp_path, capsys):
    """``gdn generate --graph --batch-size 2`` with five prompts, through the installed console script
    in a subprocess (global attention: a long prompt arrives after short ones, so rows move): what the
    eager decode prints in-process, which is each prompt alone."""
    from gdn.models import GDNConfig, GDNForCausalLM

    gdn = Path(sys.executable).with_name("gdn")
    if not gdn.exists():
        pytest.skip("the gdn console script is not installed next to this interpreter")
    torch.manual_seed(0)
    GDNForCausalLM(GDNConfig.from_preset("transformer", "tiny", hidden_size=32)).eval().save_pretrained(tmp_path / "m")
    prompts = ["x", "def f(a):", "import torch as t, numpy as np  # a much longer line than the rest", "hi", "ab"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    args = ["generate", "--ckpt", str(tmp_path / "m"), "--temperature", "0", "--max-new-tokens", "6",
            "--device", "cpu", "--prompts-file", str(tmp_path / "p.txt"), "--batch-size", "2"]
    res = subprocess.run([str(gdn), *args, "--graph"], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    singles = []
    for p in prompts:
        assert main(args[:-4] + ["--prompt", p]) == 0
        singles.append(capsys.readouterr().out)
    assert res.stdout == "---\n".join(singles)


def test_checkpoint_argument_usage_errors(capsys):
    """generate and eval need one checkpoint, by position or --ckpt: none, or two different ones,
    is a one-line usage error with exit status 2."""
    for argv, needle in ((["eval"], "a checkpoint is required"),
                         (["generate", "a", "--ckpt", "b"], "two checkpoints given")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
