"""TrainConfig checks: model keys are GDNConfig's, time_limit is positive, a config file that does
not parse is named with its line, and a warmup as long as the run is reported."""
from __future__ import annotations

import logging
import math

import pytest

from gdn.train import TrainConfig, Trainer, build_config
from gdn.train.config import read_config_file

from .helpers import small_config, write_corpus


def test_unknown_model_key_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown model keys \['hiden_size'\].*hidden_size.*num_hidden_layers"):
        TrainConfig(model={"hiden_size": 64})
    with pytest.raises(ValueError, match="hiden_size"):
        build_config(None, None, ["model.hiden_size=64"])
    assert TrainConfig(model={"hidden_size": 64, "layer_pattern": "G"}).model["hidden_size"] == 64


@pytest.mark.parametrize("value", [-3, 0, math.nan, "soon", True])
def test_time_limit_must_be_positive_or_none(value):
    with pytest.raises(ValueError, match="time_limit must be None or a positive number"):
        TrainConfig(time_limit=value)


@pytest.mark.parametrize("name", ["lr", "weight_decay", "grad_clip", "min_lr_ratio", "adam_eps"])
@pytest.mark.parametrize("value", [-1e-3, math.nan, math.inf, "fast", True])
def test_optimizer_numbers_must_be_finite_and_non_negative(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite non-negative number"):
        TrainConfig(**{name: value})
    assert getattr(TrainConfig(**{name: 0}), name) == 0  # (zero: no decay, no clip, a frozen run)


def test_time_limit_accepts_positive_numbers_and_none():
    assert TrainConfig(time_limit=None).time_limit is None
    assert TrainConfig(time_limit=5).time_limit == 5
    assert build_config(None, None, ["time_limit=0.5"]).time_limit == 0.5


def test_config_file_that_does_not_parse_names_file_and_line(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("steps: 10\nlr: 0.001\nseq_len: [16\nbatch_size: 4\n")
    with pytest.raises(ValueError) as e:
        read_config_file(y)
    msg = str(e.value)
    assert str(y) in msg and "line 4" in msg and "\n" not in msg, msg
    j = tmp_path / "c.json"
    j.write_text('{\n  "steps": 10,\n  "lr": 0.001,\n}\n')
    with pytest.raises(ValueError) as e:
        read_config_file(j)
    msg = str(e.value)
    assert str(j) in msg and "line 4" in msg and "\n" not in msg, msg


def test_set_value_that_does_not_parse_is_named():
    with pytest.raises(ValueError, match=r"--set seq_len=\[16"):
        build_config(None, None, ["seq_len=[16"])


@pytest.mark.parametrize("warmup, warned", [(2, True), (5, True), (1, False)])
def test_warmup_as_long_as_the_run_is_one_warning(tmp_path, caplog, warmup, warned):
    data = write_corpus(tmp_path / "data")
    with caplog.at_level(logging.WARNING, logger="gdn"):
        Trainer(small_config(tmp_path / "run", data, steps=2, warmup_steps=warmup))
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if warned:
        assert len(lines) == 1 and "warmup_steps" in lines[0] and "never reaches" in lines[0], lines
    else:
        assert lines == []
