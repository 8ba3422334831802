"""The training loop of ``gdn train``: data, model, AdamW + warmup/cosine, validation, metrics,
checkpoints, resume, signals, single process or torchrun (DDP / FSDP2)."""
from __future__ import annotations

import logging
import math
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .. import checkpoint as ckpt
from ..data import PackedWindows, eval_batches, load_corpus, load_tokenizer, unigram_bits_per_byte
from ..evaluation import evaluate
from ..models import GDNConfig, GDNForCausalLM, param_groups
from . import distributed as D
from .config import TrainConfig
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


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from 1 to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class _StopSignal:
    """SIGINT/SIGTERM set a flag (the loop saves and stops); a second signal interrupts at once."""

    def __init__(self):
        self.signum = 0
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        logger.warning("received %s: saving a checkpoint after this step", signal.Signals(signum).name)

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


class Trainer:
    """Builds everything from a :class:`TrainConfig`; :meth:`run` trains and returns a :class:`TrainResult`.

    ``resume``: False (fresh run; an existing run folder's checkpoints are kept but not used),
    True (the newest checkpoint under ``cfg.out``) or a checkpoint / run folder.
    """

    def __init__(self, cfg: TrainConfig, resume: bool | str = False):
        self.cfg, self.resume = cfg, resume
        self.dist = D.init(cfg.device)
        self.device = self.dist.device
        self.out = Path(cfg.out)
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.train_data, self.val_data = load_corpus(cfg.data, self.tokenizer, val_fraction=cfg.val_fraction,
                                                     text_field=cfg.text_field, bin_dtype=cfg.bin_dtype,
                                                     eos_id=cfg.eos_id)
        self.windows = PackedWindows(self.train_data, cfg.seq_len, seed=cfg.seed)
        rows = max(1, cfg.batch_size // cfg.grad_accum)
        self.val_batches = eval_batches(self.val_data, cfg.seq_len, cfg.eval_batches, rows)
        overrides = {"vocab_size": self.tokenizer.vocab_size, **cfg.model}
        self.model_config = GDNConfig.from_preset(cfg.preset, cfg.size, **overrides)
        if self.model_config.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"model.vocab_size ({self.model_config.vocab_size}) is smaller than the tokenizer's "
                             f"({self.tokenizer.vocab_size})")
        torch.manual_seed(cfg.seed)
        model = GDNForCausalLM(self.model_config).to(self.device)
        if cfg.activation_checkpointing:
            model.model.gradient_checkpointing = True
        self.model = model
        self.wrapped = D.wrap(model, cfg.distributed, self.dist)
        self.forward = torch.compile(self.wrapped) if cfg.compile else self.wrapped
        groups = param_groups(model, cfg.weight_decay)
        if not cfg.decay_embeddings:
            emb = model.get_input_embeddings().weight
            groups[0]["params"] = [p for p in groups[0]["params"] if p is not emb]
            groups[1]["params"].append(emb)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                                           foreach=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio))
        bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and self.device.type == "cuda")
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if bf16 else nullcontext
        self.step = 0
        self.unigram_bpb = unigram_bits_per_byte(self.train_data, self.val_data, self.tokenizer.vocab_size)

    # ---- checkpoints -------------------------------------------------------------------------
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
            self.model_config.save_pretrained(tmp)
            self.tokenizer.save(tmp)
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
            if self.dist.enabled:
                raise ckpt.CheckpointError(f"{path} is a single-process checkpoint (optimizer in trainer.pt); "
                                           "resume it without torchrun")
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        if state["samples"] != self.step * self.cfg.batch_size:
            logger.warning("batch_size changed since the checkpoint: data continues from sample %d",
                           self.step * self.cfg.batch_size)
        if state.get("world_size", 1) == self.dist.world_size:
            _set_rng_state(state["rng"][self.dist.rank], self.device)
        else:
            logger.warning("resuming a %d-process run on %d processes: RNG streams restart",
                           state.get("world_size", 1), self.dist.world_size)
        logger.info("resumed from %s at step %d", path, self.step)

    # ---- loop --------------------------------------------------------------------------------
    def validate(self):
        """:class:`gdn.evaluation.EvalResult` on the fixed held-out rows."""
        return evaluate(self.wrapped if self.dist.enabled else self.model, self.val_batches,
                        self.train_data.bytes_per_token, self.device, self.autocast())

    def _train_step(self) -> tuple[float, float]:
        cfg = self.cfg
        micro = self.windows.batches(self.step * cfg.batch_size, cfg.batch_size, self.dist.rank,
                                     self.dist.world_size, cfg.grad_accum)
        total = torch.zeros((), device=self.device)
        for i, (ids, cu) in enumerate(micro):
            ids, cu = ids.to(self.device), cu.to(self.device)
            sync = i == len(micro) - 1 or not hasattr(self.wrapped, "no_sync")
            with (nullcontext() if sync else self.wrapped.no_sync()), self.autocast():
                loss = self.forward(input_ids=ids, labels=ids, cu_seqlens=cu).loss / cfg.grad_accum
            loss.backward()
            total += loss.detach()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else 1e30)
        if hasattr(gnorm, "full_tensor"):
            gnorm = gnorm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(D.all_reduce(total, "mean")), float(gnorm)

    def run(self) -> TrainResult:
        """Train from the current (or resumed) step to ``cfg.steps``, or until a signal / the time limit."""
        from tqdm.auto import tqdm

        cfg, main = self.cfg, self.dist.is_main
        resumed_from = None
        if self.resume:
            resumed_from = ckpt.resolve(self.resume, self.out)
            self.load(resumed_from)
        elif ckpt.list_checkpoints(self.out):
            raise ValueError(f"{self.out} already holds checkpoints: pass --resume to continue that run, or choose "
                             "another --out")
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
            cfg.save(self.out / "config.yaml")
            self.model_config.to_json_file(str(self.out / "model_config.json"))
        log = MetricsLog(self.out, cfg.tensorboard, truncate_after=self.step if resumed_from else None) if main else None
        n_params = sum(p.numel() for p in self.model.parameters())
        logger.info("model %s/%s, %.2fM parameters, pattern %s, device %s x%d", cfg.preset, cfg.size, n_params / 1e6,
                    self.model_config.layer_pattern, self.device, self.dist.world_size)
        tokens_per_step = cfg.batch_size * cfg.seq_len
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not (main and cfg.progress), dynamic_ncols=True,
                   desc="train")
        t0, rate, loss, val, last_saved, interrupted = time.time(), 0.0, float("nan"), None, None, False
        self.wrapped.train()
        with _StopSignal() as stop:
            while self.step < cfg.steps:
                ts = time.time()
                loss, gnorm = self._train_step()
                dt = time.time() - ts
                rate = tokens_per_step / dt if rate == 0 else 0.9 * rate + 0.1 * tokens_per_step / dt
                lr = self.scheduler.get_last_lr()[0]
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}", lr=f"{lr:.2e}")
                if main and (self.step % cfg.log_every == 0 or self.step == cfg.steps):
                    log.log(self.step, loss=loss, lr=lr, grad_norm=gnorm, tokens_per_s=rate,
                            tokens=self.step * tokens_per_step)
                if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                    val = self.validate()
                    if main:
                        log.log(self.step, val_loss=val.loss, val_bpb=val.bits_per_byte, val_ppl=val.perplexity)
                        bar.write(f"step {self.step}: val loss {val.loss:.4f}, {val.bits_per_byte:.3f} bits/byte "
                                  f"(unigram {self.unigram_bpb:.3f})")
                over_time = cfg.time_limit is not None and time.time() - t0 > cfg.time_limit
                paused = cfg.stop_after is not None and self.step >= cfg.stop_after
                flag = D.all_reduce(torch.tensor([float(bool(stop.signum) or over_time or paused)], device=self.device),
                                    "max")
                interrupted = bool(flag.item())
                if self.step % cfg.save_every == 0 or self.step == cfg.steps or interrupted:
                    last_saved = self.save()
                if interrupted:
                    reason = (signal.Signals(stop.signum).name if stop.signum else
                              "time limit" if over_time else f"stop_after={cfg.stop_after}")
                    bar.write(f"stopped at step {self.step} ({reason}); checkpoint {last_saved}")
                    break
        bar.close()
        if val is None or (interrupted and cfg.eval_every > 0 and self.step % cfg.eval_every):
            val = self.validate()
            if main:
                log.log(self.step, val_loss=val.loss, val_bpb=val.bits_per_byte, val_ppl=val.perplexity)
        if main:
            log.close()
            plot_loss_curve(self.out / "metrics.jsonl", self.out / "loss_curve.png", self.unigram_bpb)
        return TrainResult(self.step, loss, val.loss, val.bits_per_byte, self.unigram_bpb, interrupted, self.out,
                           last_saved, rate)


def train(cfg: TrainConfig, resume: bool | str = False) -> TrainResult:
    """Run :class:`Trainer` and leave the process group afterwards."""
    try:
        return Trainer(cfg, resume).run()
    finally:
        D.shutdown()
