"""Training: configuration, the shared loop (:class:`TrainLoop`, :func:`lr_factor`), the language-model
run (:class:`Trainer`, :func:`train`), distributed setup and the MQAR benchmark. Checkpoint files
are :mod:`gdn.checkpoint`'s (``CheckpointError`` and ``verify`` are re-exported here)."""
from __future__ import annotations

from ..checkpoint import CheckpointError, verify
from .config import TrainConfig, build_config, resume_config
from .loop import LoopOutcome, LoopSettings, Trainer, TrainLoop, TrainResult, adamw, lr_factor, train

__all__ = ["CheckpointError", "LoopOutcome", "LoopSettings", "TrainConfig", "TrainLoop", "TrainResult", "Trainer",
           "adamw", "build_config", "lr_factor", "resume_config", "train", "verify"]
