"""`gdn eval`: bits per byte of a checkpoint, and lm-eval on a small local task (no downloads)."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from gdn.evaluation.perplexity import evaluate_checkpoint
from gdn.train import train
from gdn.checkpoint import load_model

from .helpers import small_config, write_corpus


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalrun")
    data = write_corpus(tmp / "data")
    res = train(small_config(tmp / "run", data, steps=4, save_every=4, eval_every=4))
    return res


def test_eval_checkpoint_matches_training_validation(run):
    res, unigram = evaluate_checkpoint(run.out, batches=2, batch_size=4)
    assert res.loss == pytest.approx(run.val_loss, rel=1e-5)  # same held-out rows as training's validation
    assert res.bits_per_byte == pytest.approx(res.loss / math.log(2), rel=1e-6)  # bytes: 1 token = 1 byte
    assert unigram == pytest.approx(run.unigram_bpb)


def test_lm_eval_local_task(run, tmp_path):
    pytest.importorskip("lm_eval")
    from gdn.evaluation.harness import GDNLM, run_lm_eval

    docs = [{"question": f"def f{i}(x):\n    return x *", "choices": [" 2\n", " banana\n"], "answer": 0} for i in range(6)]
    (tmp_path / "toy.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (tmp_path / "toy.yaml").write_text(f"""task: gdn_toy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / 'toy.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    results = run_lm_eval(run.out, ["gdn_toy"], batch_size=4, include_path=str(tmp_path))
    assert 0.0 <= results["gdn_toy"]["acc,none"] <= 1.0
    # the adapter's log-likelihood equals a direct computation with the model
    lm = GDNLM(str(run.out))
    model, tok, _ = load_model(run.out, "cpu")
    ctx, cont = "def f(x):\n    return", " x + 1"
    (ll, greedy), = lm.loglikelihood([SimpleNamespace(args=(ctx, cont))])
    ids = torch.tensor([tok.encode(ctx + cont)])
    with torch.no_grad():
        logp = model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)[0]
    n = len(tok.encode(cont))
    want = sum(float(logp[t - 1, ids[0, t]]) for t in range(ids.shape[1] - n, ids.shape[1]))
    assert ll == pytest.approx(want, abs=1e-4)
    (rolled,) = lm.loglikelihood_rolling([SimpleNamespace(args=("abc def",))])
    assert rolled < 0
