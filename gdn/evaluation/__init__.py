"""Evaluation: perplexity and bits per byte on held-out text, and the lm-evaluation-harness."""
from __future__ import annotations

from .perplexity import EvalResult, evaluate, score_packed

__all__ = ["EvalResult", "evaluate", "score_packed"]
