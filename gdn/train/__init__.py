"""Training: configuration, loop, distributed setup and the MQAR benchmark. Checkpoint files are
:mod:`gdn.checkpoint`'s (``CheckpointError`` and ``verify`` are re-exported here)."""
from __future__ import annotations

from ..checkpoint import CheckpointError, verify
from .config import TrainConfig, build_config
from .loop import Trainer, TrainResult, lr_factor, train

__all__ = ["CheckpointError", "TrainConfig", "TrainResult", "Trainer", "build_config", "lr_factor", "train", "verify"]
