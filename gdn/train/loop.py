"""The training loop: :class:`TrainLoop` (micro-batches, autocast, gradient clipping, AdamW +
warmup/cosine, metrics, validation, optional checkpoints and signals) and :class:`Trainer`, the
language-model run of ``gdn train`` on top of it (data, model, checkpoints, resume, single process
or torchrun with DDP / FSDP2). ``gdn mqar`` runs its cells through the same :class:`TrainLoop`."""
from __future__ import annotations

import logging
import math
import signal
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .. import checkpoint as ckpt
from ..data import PackedWindows, eval_batches, load_corpus, load_tokenizer, unigram_bits_per_byte
from ..distributed import ContextParallel
from ..evaluation import evaluate
from ..models import GDNConfig, GDNForCausalLM, param_groups
from ..ops import offsets
from . import distributed as D
from .clip import EPS as CLIP_EPS, global_norm, step_clipped
from .config import TrainConfig, changed_settings, read_saved_config
from .metrics import MetricsLog, plot_loss_curve

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run ended with."""

    step: int
    train_loss: float
    val_loss: float | None
    val_bpb: float | None
    unigram_bpb: float
    interrupted: bool
    out: Path
    checkpoint: Path | None
    tokens_per_s: float
    trained: int = 0  #: steps this run trained (0: it started at or past its last step)
    skipped: int = 0  #: of those, steps whose update was skipped (non-finite loss or gradient norm)
    diverged: bool = False  #: stopped after ``max_bad_steps`` such steps in a row


def lr_factor(step: int, warmup: int, total: int, min_ratio: float = 0.0, decay: int | None = None) -> float:
    """Learning-rate multiplier at ``step`` (0-based): linear warmup over ``warmup`` steps, then a
    cosine from 1 to ``min_ratio`` at ``total``. With ``decay`` the cosine spans only the last
    ``decay`` steps before ``total`` and the factor stays 1 between warmup and them; ``None`` means
    the cosine starts right after warmup."""
    if step < warmup:
        return (step + 1) / warmup
    start = warmup if decay is None else total - decay
    if step < start:
        return 1.0
    progress = min(1.0, (step - start) / max(1, total - start))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float = 1e-8,
          decay_embeddings: bool = True) -> torch.optim.AdamW:
    """AdamW over :func:`gdn.models.param_groups` (no decay on norms, biases, ``A_log``, ``dt_bias``;
    none on the input embedding either unless ``decay_embeddings``). On CUDA torch's fused form
    (one pass over each parameter, its gradient and moments, and the step counts on the GPU: no
    host work per parameter), else the multi-tensor one."""
    groups = param_groups(model, weight_decay)
    if not decay_embeddings:
        emb = model.get_input_embeddings().weight
        groups[0]["params"] = [p for p in groups[0]["params"] if p is not emb]
        groups[1]["params"].append(emb)
    cuda = all(p.is_cuda for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **({"fused": True} if cuda else {"foreach": True}))


def autocast_for(device: torch.device, dtype: str = "auto"):
    """A callable returning the forward's autocast context: bf16 for ``dtype="bf16"``, or for
    ``"auto"`` on CUDA; none (fp32) otherwise."""
    if dtype == "bf16" or (dtype == "auto" and device.type == "cuda"):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext


class _StopSignal:
    """SIGINT/SIGTERM set a flag (the loop saves and stops); a second signal interrupts at once,
    except inside :meth:`deferred` (a checkpoint being written), where every signal only sets the
    flag: an interrupted save would leave a partial checkpoint. Disabled, it leaves the handlers
    alone and never sets the flag."""

    def __init__(self, enabled: bool = True):
        self.signum = 0
        self.enabled = enabled
        self._deferred = False
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM) if self.enabled else ():
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self._deferred:
            self.signum = self.signum or signum
            logger.warning("received %s while writing a checkpoint: stopping once it is complete", name)
            return
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        logger.warning("received %s: saving a checkpoint after this step", name)

    @contextmanager
    def deferred(self):
        """Inside: signals set the flag and nothing more."""
        self._deferred = True
        try:
            yield
        finally:
            self._deferred = False

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


@dataclass
class LoopSettings:
    """How a :class:`TrainLoop` runs. A :class:`TrainConfig` has the same fields and serves as one."""

    steps: int  #: optimizer steps
    grad_clip: float = 1.0  #: max global gradient norm (0 = measured, not clipped)
    log_every: int = 10  #: steps between metric lines (when the loop keeps a metrics log)
    eval_every: int = 0  #: steps between validations (0: only at the end)
    save_every: int = 0  #: steps between checkpoints (0: no checkpoints, signals not caught)
    progress: bool = False  #: show a progress bar
    time_limit: float | None = None  #: stop after this many seconds
    stop_after: int | None = None  #: stop after this step
    max_bad_steps: int = 10  #: stop after this many steps in a row with a non-finite loss or gradient norm


@dataclass
class LoopOutcome:
    """What :meth:`TrainLoop.fit` ended with: the last step's loss, the last validation's metrics
    (None without validation), the last checkpoint (None without checkpoints)."""

    step: int
    train_loss: float
    metrics: dict | None
    interrupted: bool
    checkpoint: Path | None
    tokens_per_s: float
    trained: int = 0  #: steps run by this call
    skipped: int = 0  #: of those, steps whose update was skipped (non-finite loss or gradient norm)
    diverged: bool = False  #: stopped after ``settings.max_bad_steps`` such steps in a row


class TrainLoop:
    """The optimisation loop of ``gdn train`` and ``gdn mqar``.

    Every step runs the micro-batches of :meth:`micro_batches` (forward under ``autocast``, each
    loss divided by their count, backward; gradients synchronised only on the last one under DDP),
    clips the global gradient norm at ``settings.grad_clip``, then steps the optimizer and the
    scheduler (build them with :func:`adamw` and :func:`lr_factor`). A step whose loss or gradient
    norm is not finite applies no update (the weights and the optimizer's moments stay as they were;
    the step still counts, so its data is not seen twice) and is logged; after
    ``settings.max_bad_steps`` such steps in a row the run stops as on a signal, with a checkpoint
    of the weights from before them. Every ``log_every`` steps the
    loss, lr, gradient norm and throughput go to the metrics log of :meth:`begin`; every
    ``eval_every`` steps and at the end :meth:`validate` is logged; with ``save_every`` > 0 a
    checkpoint is written every ``save_every`` steps, at the end and when the run stops early
    (SIGINT/SIGTERM, ``time_limit``, ``stop_after``).

    A subclass supplies :meth:`micro_batches` and :meth:`loss`, and where it needs them
    :meth:`validate`, :meth:`begin` (the log), :meth:`save` and :meth:`finish`.

    Args:
        model: the module whose parameters are clipped. optimizer, scheduler: stepped once per step.
        settings: a :class:`LoopSettings` (or a :class:`TrainConfig`), read at every step.
        device: where losses are reduced. dist: the :class:`DistInfo` (default: one process).
        wrapped: the DDP / FSDP module (default ``model``). autocast: a callable returning the
            forward's autocast context. tokens_per_step: for the throughput figure.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, settings, *,
                 device: torch.device, dist: D.DistInfo | None = None, wrapped: torch.nn.Module | None = None,
                 autocast=nullcontext, tokens_per_step: int = 0):
        self.model, self.optimizer, self.scheduler, self.settings = model, optimizer, scheduler, settings
        self.device = device
        self.dist = dist if dist is not None else D.DistInfo(device=device)
        self.wrapped = wrapped if wrapped is not None else model
        self.autocast = autocast
        self.tokens_per_step = tokens_per_step
        self.step = 0
        self.skipped = 0  #: steps of this process's runs whose update was skipped
        self.bad_in_a_row = 0

    # ---- what a run supplies -------------------------------------------------------------------
    def micro_batches(self) -> list:
        """The micro-batches of optimizer step ``self.step`` (0-based)."""
        raise NotImplementedError

    def loss(self, batch) -> torch.Tensor:
        """The mean loss of one micro-batch (a scalar with a gradient)."""
        raise NotImplementedError

    def validate(self) -> dict | None:
        """``{metric: number}`` on held-out data, or None (no validation)."""
        return None

    def validation_message(self, metrics: dict) -> str | None:
        """A line for the progress output after an in-run validation, or None."""
        return None

    def begin(self):
        """Prepare the run (before the first step); the metrics log (``log(step, **values)``,
        ``close()``) of this process, or None for no metric lines."""
        return None

    def save(self) -> Path:
        """Write a checkpoint of step ``self.step``; its folder (needed when ``save_every`` > 0)."""
        raise NotImplementedError

    def finish(self) -> None:
        """After the last step and validation (the log is closed)."""

    # ---- the loop ------------------------------------------------------------------------------
    def train_step(self) -> tuple[float, float]:
        """One optimizer step: ``(loss averaged over ranks, global gradient norm before clipping)``."""
        micro = self.micro_batches()
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro):
            sync = i == len(micro) - 1 or not hasattr(self.wrapped, "no_sync")
            with (nullcontext() if sync else self.wrapped.no_sync()), self.autocast():
                loss = self.loss(batch) / len(micro)
            loss.backward()
            total += loss.detach()
        clip = self.settings.grad_clip
        params = list(self.model.parameters())  # (those without a gradient are passed over)
        norm = global_norm(params)
        # the same numbers on every rank (the mean loss, the global norm), so the same decision
        loss = float(D.all_reduce(total, "mean"))
        gnorm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(loss) and math.isfinite(gnorm):
            # bounded only where the bound bites (its scale is 1 otherwise): the fused update then
            # leaves the gradients as they are
            step_clipped(self.optimizer, params, clip if gnorm + CLIP_EPS > clip > 0 else 0.0, norm)
            self.bad_in_a_row = 0
        else:
            self.skipped += 1
            self.bad_in_a_row += 1
            if self.dist.is_main:
                logger.warning("step %d: loss %s, gradient norm %s: update skipped (%d in a row)", self.step + 1,
                               loss, gnorm, self.bad_in_a_row)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss, gnorm

    def _validate(self, log, bar=None) -> dict | None:
        metrics = self.validate()
        if metrics is not None and log is not None:
            log.log(self.step, **metrics)
        if metrics is not None and bar is not None and self.dist.is_main:
            message = self.validation_message(metrics)
            if message:
                bar.write(message)
        return metrics

    def fit(self) -> LoopOutcome:
        """Train from ``self.step`` to ``settings.steps``, or until a signal / the time limit / ``stop_after``."""
        from tqdm.auto import tqdm

        s = self.settings
        log = self.begin()
        bar = tqdm(total=s.steps, initial=self.step, disable=not (self.dist.is_main and s.progress),
                   dynamic_ncols=True, desc="train")
        checkpoints = s.save_every > 0
        t0, rate, loss, val, last_saved, interrupted = time.time(), 0.0, float("nan"), None, None, False
        first, skipped0, diverged = self.step, self.skipped, False
        self.wrapped.train()
        with _StopSignal(enabled=checkpoints) as stop:
            while self.step < s.steps:
                ts = time.time()
                loss, gnorm = self.train_step()
                dt = time.time() - ts
                rate = self.tokens_per_step / dt if rate == 0 else 0.9 * rate + 0.1 * self.tokens_per_step / dt
                lr = self.scheduler.get_last_lr()[0]
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}", lr=f"{lr:.2e}")
                if log is not None and (self.step % s.log_every == 0 or self.step == s.steps):
                    log.log(self.step, loss=loss, lr=lr, grad_norm=gnorm, tokens_per_s=rate,
                            tokens=self.step * self.tokens_per_step)
                    if bar.disable:  # a run with a metrics log and no progress bar: its metric line shown too
                        logger.info("step %d/%d: loss %.4f, grad norm %.3g, lr %.2e, %s tokens/s", self.step,
                                    s.steps, loss, gnorm, lr, f"{rate:,.0f}")
                if s.eval_every and (self.step % s.eval_every == 0 or self.step == s.steps):
                    val = self._validate(log, bar)
                over_time = s.time_limit is not None and time.time() - t0 > s.time_limit
                paused = s.stop_after is not None and self.step >= s.stop_after
                diverged = self.bad_in_a_row >= s.max_bad_steps
                interrupted = D.any_rank(bool(stop.signum) or over_time or paused or diverged, self.device)
                if checkpoints and (self.step % s.save_every == 0 or self.step == s.steps or interrupted):
                    with stop.deferred():
                        last_saved = self.save()
                    if not interrupted:  # a signal during the save: stop now, the checkpoint is current
                        interrupted = D.any_rank(bool(stop.signum), self.device)
                if interrupted:
                    reason = (signal.Signals(stop.signum).name if stop.signum else
                              f"{self.bad_in_a_row} steps in a row with a non-finite loss or gradient norm, "
                              "updates skipped" if diverged else
                              "time limit" if over_time else f"stop_after={s.stop_after}")
                    bar.write(f"stopped at step {self.step} ({reason}); checkpoint {last_saved}")
                    break
        bar.close()
        if val is None or (interrupted and s.eval_every > 0 and self.step % s.eval_every):
            val = self._validate(log)
        if log is not None:
            log.close()
        self.finish()
        return LoopOutcome(self.step, loss, val, interrupted, last_saved, rate, self.step - first,
                           self.skipped - skipped0, diverged)


class Trainer(TrainLoop):
    """The language-model run of ``gdn train``: builds data, model, optimizer and schedule from a
    :class:`TrainConfig` (which is also its :class:`LoopSettings`); :meth:`run` trains through
    :meth:`TrainLoop.fit` and returns a :class:`TrainResult`. Checkpoints: :mod:`gdn.checkpoint`.

    ``resume``: False (fresh run; a run folder that holds checkpoints is refused), True (the newest
    checkpoint under ``cfg.out``) or a checkpoint / run folder. The checkpoint is verified and its
    model config compared with ``cfg``'s before anything is loaded (a different model raises
    ValueError naming the fields); settings of ``cfg`` that differ from the checkpoint's are named in
    one warning. :func:`gdn.train.config.resume_config` builds a resumed run's ``cfg`` from the
    checkpoint's settings.
    """

    def __init__(self, cfg: TrainConfig, resume: bool | str = False):
        self.cfg, self.resume = cfg, resume
        self.dist = D.init(cfg.device, cfg.context_parallel)
        self.device = self.dist.device
        self.out = Path(cfg.out)
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        overrides = {"vocab_size": self.tokenizer.vocab_size, **cfg.model}
        self.model_config = GDNConfig.from_preset(cfg.preset, cfg.size, **overrides)
        if self.model_config.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"model.vocab_size ({self.model_config.vocab_size}) is smaller than the tokenizer's "
                             f"({self.tokenizer.vocab_size})")
        self.checkpoint = self._check_resume() if resume else None
        if not resume and ckpt.list_checkpoints(self.out):
            raise ValueError(f"{self.out} already holds checkpoints: pass --resume to continue that run, or choose "
                             "another --out")
        if cfg.warmup_steps >= cfg.steps and self.dist.is_main:
            logger.warning("warmup_steps (%d) >= steps (%d): the learning rate never reaches its peak lr=%g",
                           cfg.warmup_steps, cfg.steps, cfg.lr)
        self.train_data, self.val_data = load_corpus(cfg.data, self.tokenizer, val_fraction=cfg.val_fraction,
                                                     text_field=cfg.text_field, bin_dtype=cfg.bin_dtype,
                                                     eos_id=cfg.eos_id)
        self.windows = PackedWindows(self.train_data, cfg.seq_len, seed=cfg.seed)
        rows = max(1, cfg.batch_size // cfg.grad_accum)
        self.val_batches = eval_batches(self.val_data, cfg.seq_len, cfg.eval_batches, rows)
        torch.manual_seed(cfg.seed)
        model = GDNForCausalLM(self.model_config).to(self.device)
        if cfg.activation_checkpointing:
            model.model.gradient_checkpointing = True
        wrapped = D.wrap(model, cfg.distributed, self.dist)
        self.forward = torch.compile(wrapped) if cfg.compile else wrapped
        optimizer = adamw(model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), cfg.adam_eps, cfg.decay_embeddings)
        # cfg is read when the schedule is: a change of cfg.steps before run() reaches the schedule too
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
        super().__init__(model, optimizer, scheduler, cfg, device=self.device, dist=self.dist, wrapped=wrapped,
                         autocast=autocast_for(self.device, cfg.dtype), tokens_per_step=cfg.batch_size * cfg.seq_len)
        self.unigram_bpb = unigram_bits_per_byte(self.train_data, self.val_data, self.tokenizer.vocab_size)

    # ---- checkpoints -------------------------------------------------------------------------
    def _check_resume(self) -> Path:
        """The verified checkpoint to resume; ValueError when its model differs from this run's; one
        warning naming the settings that differ from the checkpoint's."""
        path = ckpt.resolve(self.resume, self.out)
        saved = GDNConfig.from_pretrained(str(path))
        diff = saved.differences(self.model_config)
        if diff:
            raise ValueError(f"cannot resume {path} with another model: {', '.join(diff)} (checkpoint -> now); "
                             "keep the run's model settings, or start a new run in another folder")
        if self.dist.is_main and (path / "train_config.yaml").is_file():
            changed = changed_settings(read_saved_config(path / "train_config.yaml"), self.cfg.to_dict())
            if changed:
                logger.warning("resuming %s with changed settings: %s", self.cfg.out, ", ".join(changed))
        return path

    def _write_run_config(self) -> None:
        """``OUT/config.yaml`` and ``OUT/model_config.json``. A resumed run whose settings changed keeps
        the previous ``config.yaml`` as ``config.step_XXXXXXXX.yaml`` (XXXXXXXX: the step it resumed at)."""
        path, text = self.out / "config.yaml", self.cfg.to_yaml()
        if self.checkpoint is not None and path.is_file() and (old := path.read_text()) != text:
            keep, n = self.out / f"config.step_{self.step:08d}.yaml", 1
            while keep.exists():
                n += 1
                keep = self.out / f"config.step_{self.step:08d}.{n}.yaml"
            ckpt.atomic_write_text(keep, old)
            logger.info("the previous config.yaml is kept as %s", keep)
        ckpt.atomic_write_text(path, text)
        ckpt.atomic_write_text(self.out / "model_config.json", self.model_config.to_json_string())

    def save(self) -> Path:
        """Write a checkpoint of the current step (all ranks take part)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        cfg, step = self.cfg, self.step
        tmp = ckpt.temp_dir(self.out, step)
        if self.dist.is_main:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        D.barrier()
        if self.dist.enabled:
            full = get_model_state_dict(self.wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            full = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        rngs = D.gather_objects(_rng_state(self.device))
        state = {"step": step, "samples": step * cfg.batch_size, "scheduler": self.scheduler.state_dict(),
                 "rng": rngs, "world_size": self.dist.world_size}
        if self.dist.enabled:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(self.wrapped, self.optimizer)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "dcp"))
        else:
            state["optimizer"] = self.optimizer.state_dict()
        if self.dist.is_main:
            if self.model_config.tie_word_embeddings:
                full.pop("lm_head.weight", None)
            save_file({k: v.contiguous() for k, v in full.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            from ..hf import save_for_transformers

            # config.json with the tokenizer's special ids, generation_config.json, tokenizer files
            save_for_transformers(tmp, self.model_config, self.tokenizer)
            cfg.save(tmp / "train_config.yaml")
            torch.save(state, tmp / "trainer.pt")
        D.barrier()
        path = ckpt.step_dir(self.out, step)
        if self.dist.is_main:
            ckpt.finalize(self.out, step, cfg.keep_last, {"world_size": self.dist.world_size})
        D.barrier()
        return path

    def load(self, path: Path) -> None:
        """Restore model, optimizer, scheduler, data position and RNG from a verified checkpoint."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                             set_state_dict)

        state = torch.load(path / "trainer.pt", weights_only=True, map_location="cpu")
        if (path / "dcp").is_dir():
            import torch.distributed.checkpoint as dcp

            msd, osd = get_state_dict(self.wrapped, self.optimizer)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=str(path / "dcp"))
            set_state_dict(self.wrapped, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        else:
            weights = load_file(str(path / "model.safetensors"), device="cpu")
            if self.model_config.tie_word_embeddings:
                weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
            if self.dist.enabled:
                set_model_state_dict(self.wrapped, weights, options=StateDictOptions(full_state_dict=True))
            else:
                self.model.load_state_dict(weights)
            if self.dist.enabled:  # a single-process checkpoint on several ranks: the full optimizer state by name
                from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

                set_optimizer_state_dict(self.wrapped, self.optimizer,
                                         _optimizer_by_name(self.model, self.optimizer, state["optimizer"]),
                                         options=StateDictOptions(full_state_dict=True))
            else:
                self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        if state["samples"] != self.step * self.cfg.batch_size:
            logger.info("batch_size changed since the checkpoint: data continues from sample %d",
                        self.step * self.cfg.batch_size)
        if state.get("world_size", 1) == self.dist.world_size:
            _set_rng_state(state["rng"][self.dist.rank], self.device)
        else:
            logger.warning("resuming a %d-process run on %d processes: RNG streams restart",
                           state.get("world_size", 1), self.dist.world_size)
        logger.info("resumed from %s at step %d", path, self.step)

    # ---- what the loop runs -----------------------------------------------------------------
    def micro_batches(self) -> list:
        """``grad_accum`` packed rows ``(ids [1, L], cu_seqlens)`` of this rank's share of the step's samples
        (the same rows on the ranks of a context-parallel group)."""
        cfg = self.cfg
        return self.windows.batches(self.step * cfg.batch_size, cfg.batch_size, self.dist.dp_rank, self.dist.dp_size,
                                    cfg.grad_accum)

    def loss(self, batch) -> torch.Tensor:
        """Next-token loss of one packed row (no prediction across its documents' boundaries). With
        context parallelism: this rank's share of the row's mean loss times the group size (the
        mean over ranks of DDP / FSDP is then the mean over rows)."""
        ids, cu = batch[0].to(self.device), offsets.to_device(batch[1], self.device)
        if self.dist.cp_size == 1:
            return self.forward(input_ids=ids, labels=ids, cu_seqlens=cu).loss
        cp = ContextParallel.split(self.dist.cp_group, ids.shape[1], batch[1], self.cfg.context_parallel_attention)
        return self.forward(input_ids=cp.shard(ids), labels=ids, context_parallel=cp).loss * cp.size

    def evaluate(self):
        """:class:`gdn.evaluation.EvalResult` on the fixed held-out rows."""
        return evaluate(self.wrapped if self.dist.enabled else self.model, self.val_batches,
                        self.train_data.bytes_per_token, self.device, self.autocast())

    def validate(self) -> dict:
        """``val_loss`` (nats/token), ``val_bpb`` (bits/byte) and ``val_ppl`` of :meth:`evaluate`."""
        val = self.evaluate()
        return {"val_loss": val.loss, "val_bpb": val.bits_per_byte, "val_ppl": val.perplexity}

    def validation_message(self, metrics: dict) -> str:
        return (f"step {self.step}: val loss {metrics['val_loss']:.4f}, {metrics['val_bpb']:.3f} bits/byte "
                f"(unigram {self.unigram_bpb:.3f})")

    def begin(self):
        """Load the checkpoint to resume (if any), write the run's configs; the metrics log (rank 0;
        continued after the resumed step)."""
        cfg, main = self.cfg, self.dist.is_main
        if self.checkpoint is not None:
            self.load(self.checkpoint)
            if self.step > cfg.steps:
                raise ValueError(f"steps = {cfg.steps} is below the checkpoint's step {self.step}: pass --steps "
                                 f"above {self.step} to train further")
            if self.step == cfg.steps:
                logger.info("the run is at its last step (%d): nothing to train; pass a larger --steps to "
                            "continue it", self.step)
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
            self._write_run_config()
        resumed = self.checkpoint is not None
        log = MetricsLog(self.out, cfg.tensorboard, truncate_after=self.step if resumed else None) if main else None
        n_params = sum(p.numel() for p in self.model.parameters())
        logger.info("model %s/%s, %.2fM parameters, pattern %s, device %s x%d%s", cfg.preset, cfg.size,
                    n_params / 1e6, self.model_config.layer_pattern, self.device, self.dist.world_size,
                    f" ({self.dist.dp_size} data x {self.dist.cp_size} context parallel, "
                    f"{cfg.context_parallel_attention} attention)" if self.dist.cp_size > 1
                    else "")
        return log

    def finish(self) -> None:
        """The loss curve beside the metrics."""
        if self.dist.is_main:
            plot_loss_curve(self.out / "metrics.jsonl", self.out / "loss_curve.png", self.unigram_bpb)

    def run(self) -> TrainResult:
        """Train from the current (or resumed) step to ``cfg.steps``, or until a signal / the time limit."""
        o = self.fit()
        return TrainResult(o.step, o.train_loss, o.metrics["val_loss"], o.metrics["val_bpb"], self.unigram_bpb,
                           o.interrupted, self.out, o.checkpoint, o.tokens_per_s, o.trained, o.skipped, o.diverged)


def _optimizer_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """A single-process ``optimizer.state_dict()`` (parameters by position) keyed by parameter name, the
    form ``set_optimizer_state_dict`` takes; positions follow ``optimizer``'s groups, built the same way."""
    names = {id(p): n for n, p in model.named_parameters()}
    ours = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    theirs = [g["params"] for g in saved["param_groups"]]
    if [len(g) for g in ours] != [len(g) for g in theirs]:
        raise ckpt.CheckpointError(f"the checkpoint's optimizer groups hold {[len(g) for g in theirs]} parameters, "
                                   f"this run's {[len(g) for g in ours]} (was decay_embeddings changed?)")
    by_name = {i: n for g_ours, g_theirs in zip(ours, theirs) for i, n in zip(g_theirs, g_ours)}
    return {"state": {by_name[i]: v for i, v in saved["state"].items()},
            "param_groups": [{**g, "params": names_} for g, names_ in zip(saved["param_groups"], ours)]}


def train(cfg: TrainConfig, resume: bool | str = False) -> TrainResult:
    """Run :class:`Trainer` and leave the process group afterwards."""
    try:
        return Trainer(cfg, resume).run()
    finally:
        D.shutdown()
