"""lm-evaluation-harness on a gdn checkpoint, through lm-eval's Python API.

:class:`GDNLM` implements lm-eval's ``LM`` interface on top of :class:`gdn.models.GDNForCausalLM`
and the checkpoint's own tokenizer (bytes or BPE): log-likelihoods are scored many requests at a
time as one packed row with ``cu_seqlens``; generation uses :mod:`gdn.generation`. It is
registered with lm-eval as model ``gdn`` (``pretrained=CKPT``). Saved checkpoints are also
ordinary Hugging Face folders (``AutoModelForCausalLM`` knows model type ``gdn``).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ..ops import offsets

logger = logging.getLogger(__name__)


def _lm_base():
    try:
        from lm_eval.api.model import LM
    except ImportError as e:  # pragma: no cover - depends on the optional extra
        raise ImportError("lm-eval is not installed: pip install 'lm-eval>=0.4' (or '.[eval]' in a clone of gdn)") from e
    return LM


class GDNLM(_lm_base()):
    """lm-eval model over a gdn checkpoint.

    Args:
        pretrained: checkpoint folder or run folder.
        batch_size: requests scored per packed forward pass.
        max_length: longest context in tokens (longer contexts keep their end).
        device: cpu / cuda (default cuda when available).
    """

    def __init__(self, pretrained: str, batch_size: int | str = 8, max_length: int = 2048, device: str | None = None):
        super().__init__()
        from ..checkpoint import load_model

        self.model, self.tok, self.path = load_model(pretrained, device)
        self._device = next(self.model.parameters()).device
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_length = int(max_length)
        self.prefix = [self.tok.eos_id] if self.tok.eos_id is not None else self.tok.encode("\n")

    @property
    def device(self):
        return self._device

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum log p(continuation), continuation is greedy)."""
        seqs, spans = [], []
        for ctx, cont in pairs:
            ids = (ctx + cont)[-(self.max_length + 1):]
            n = min(len(cont), len(ids) - 1)
            seqs.append(ids[:-1])
            spans.append((ids[-n:], n))
        lens = [len(s) for s in seqs]
        flat = torch.tensor([t for s in seqs for t in s], device=self._device)[None]
        cu = offsets.to_device(torch.tensor([0] + lens).cumsum(0).to(torch.int32), self._device)
        with torch.no_grad():
            logp = F.log_softmax(self.model(input_ids=flat, cu_seqlens=cu, use_cache=False).logits[0].float(), -1)
        out = []
        for (target, n), end in zip(spans, cu[1:].tolist()):
            lp = logp[end - n : end]
            tgt = torch.tensor(target, device=self._device)
            out.append((float(lp.gather(1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all())))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), greedy?)`` for each ``(context, continuation)`` request."""
        pairs = []
        for r in requests:
            ctx, cont = r.args
            pairs.append(((self.tok.encode(ctx) if ctx else []) or self.prefix, self.tok.encode(cont)))
        out = []
        for i in range(0, len(pairs), self.batch_size):
            out.extend(self._score(pairs[i : i + self.batch_size]))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Log-likelihood of each whole string, in windows of ``max_length`` tokens."""
        out = []
        for r in requests:
            ids = self.tok.encode(r.args[0])
            pairs, prev = [], self.prefix
            for i in range(0, len(ids), self.max_length):
                pairs.append((prev, ids[i : i + self.max_length]))
                prev = ids[i + self.max_length - 1 : i + self.max_length]
            out.append(sum(s for s, _ in self._score(pairs)))
        return out

    def generate_until(self, requests) -> list[str]:
        """Greedy continuation of each context, cut at the first ``until`` string."""
        from ..generation import stream

        out = []
        for r in requests:
            ctx, kw = r.args
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = ((self.tok.encode(ctx) if ctx else []) or self.prefix)[-self.max_length:]
            new, text = [], ""
            for t in stream(self.model, torch.tensor([ids], device=self._device),
                            max_new_tokens=int(kw.get("max_gen_toks", 128)), eos_token_id=self.tok.eos_id):
                new.append(int(t[0]))
                text = self.tok.decode(new)
                if any(u in text for u in until):
                    break
            for u in until:
                text = text.split(u)[0]
            out.append(text)
        return out


def _is_download_error(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is a failed download: no network, hub offline, missing cache."""
    words = ("connection", "offline", "resolve", "timeout", "timed out", "network", "hub", "couldn't reach",
             "no such host", "name or service", "localentrynotfound", "max retries")
    while e is not None:
        text = f"{type(e).__name__} {e}".lower()
        if any(w in text for w in words):
            return True
        e = e.__cause__ or e.__context__
    return False


def register() -> None:
    """Register :class:`GDNLM` with lm-eval as ``gdn`` (idempotent)."""
    from lm_eval.api.registry import model_registry, register_model

    if "gdn" not in model_registry:
        register_model("gdn")(GDNLM)


def run_lm_eval(ckpt, tasks: list[str], *, batch_size: int = 8, limit: int | None = None, device: str | None = None,
                include_path: str | None = None, num_fewshot: int | None = None) -> dict[str, dict]:
    """Run lm-eval ``tasks`` on a checkpoint; ``{task: {metric: value}}``. ``include_path``: a folder of
    extra task YAMLs (local tasks). Tasks fetch their datasets unless they point at local files."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    if not tasks or not all(isinstance(t, str) and t for t in tasks):
        raise ValueError(f"tasks must be a non-empty list of task names, got {tasks!r}")
    register()
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}; `lm_eval ls tasks` lists them, and --include-path "
                         "adds a folder of task YAMLs")
    lm = GDNLM(str(ckpt), batch_size=batch_size, device=device)
    try:
        res = evaluator.simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=manager,
                                        num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0)
    except Exception as e:  # noqa: BLE001 - only download failures are re-worded, the rest re-raised
        if not _is_download_error(e):
            raise
        raise ValueError(f"the data of task(s) {', '.join(tasks)} could not be downloaded ({type(e).__name__}); "
                         "without network, write a task YAML whose dataset points at local files (e.g. "
                         "dataset_path: json, dataset_kwargs: {data_files: ...}) and pass its folder with "
                         "--include-path") from e
    return {t: {k: v for k, v in m.items() if k != "alias"} for t, m in res["results"].items()}
