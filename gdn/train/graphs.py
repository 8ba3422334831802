"""A whole training step replayed from one CUDA graph: :class:`GraphedStep`.

A language model's step launches about five hundred kernels and runs some thousands of PyTorch
operators and a few hundred autograd nodes on the host. Where the host takes longer per step than
the GPU does (a 340m model on a slow host: docs/BENCHMARKS.md §4), the GPU waits on it whatever the
kernels cost. Captured once, the step's kernels replay with no host work between them: the host
copies the batch into the graph's input buffers and launches the graph.

What a captured step needs, and how this class provides it:

- Fixed shapes: every batch has the shape of the first (``ValueError`` otherwise).
- Nothing that waits on the GPU or reads a device value on the host inside the step: the
  forward, backward, clipping and update are device work only. The non-finite check is made on
  the device too: the optimizer must take ``found_inf`` (torch's fused Adam and AdamW; their
  update is skipped, moments and step counts left as they were, where the loss or gradient norm
  is not finite).
- Everything allocated once: the first ``warmup`` calls run eagerly on a side stream (the kernels
  compile, the optimizer makes its state, the ops' index tensors are built and kept), then one
  call captures the step and every call after replays it. Each call is one real training step.
  At the capture the optimizer's parameter groups are made ``capturable`` (torch's optimizers
  refuse a capture otherwise).
- A learning rate that changes between replays lives in a tensor (``lr=torch.tensor(...)`` when
  the optimizer is built): a float is baked into the graph at capture.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from . import clip


class GraphedStep:
    """``step(batch) -> (loss, grad norm)`` of a fixed-shape training step, replayed from a CUDA
    graph after ``warmup`` eager calls.

    Args:
        model: the module trained. optimizer: stepped once a call; takes ``found_inf`` (torch's
            fused Adam / AdamW). loss_fn: ``loss_fn(model, batch) -> scalar loss`` (default
            ``model(**batch).loss``). autocast: a callable returning the forward's autocast
            context. grad_clip: the global gradient norm's bound (0: not clipped, the norm still
            returned). warmup: eager calls before the capture (at least 1).

    ``batch`` is a dict of CUDA tensors, copied into the graph's own buffers at every call. The
    returned loss and norm are the graph's output tensors (overwritten by the next call): read
    them, or clone them, before it. A step whose loss or norm is not finite applies no update.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, loss_fn=None, autocast=None,
                 grad_clip: float = 0.0, warmup: int = 3):
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedStep: CUDA graphs need a CUDA device, and none is available")
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ValueError(f"GraphedStep: optimizer must skip its update on the device (take found_inf: torch's "
                             f"fused Adam or AdamW), got {type(optimizer).__name__} "
                             f"(fused={optimizer.defaults.get('fused')})")
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"GraphedStep: warmup must be an int >= 1, got {warmup!r}")
        self.model, self.optimizer = model, optimizer
        self.loss_fn = loss_fn or (lambda m, b: m(**b).loss)
        self.autocast = autocast or nullcontext
        self.grad_clip, self.warmup = float(grad_clip), warmup
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.calls = 0
        self.graph = None
        self.static: dict | None = None
        self.out: tuple | None = None
        self.stream = torch.cuda.Stream()

    def _body(self) -> tuple:
        """Forward, backward, clipping and the update of one step on ``self.static``; its (loss,
        grad norm) as device tensors. Device work only: no value is read back."""
        with self.autocast():
            loss = self.loss_fn(self.model, self.static)
        loss.backward()
        # the bound applied by the fused update itself (gdn.train.clip): no pass over the gradients
        # of its own, and none at all without a bound
        norm = clip.global_norm(self.params)
        loss = loss.detach().float()
        bad = (~torch.isfinite(loss) | ~torch.isfinite(norm)).float()
        clip.step_clipped(self.optimizer, self.params, self.grad_clip, norm, found_inf=bad)
        return loss, norm

    def _take(self, batch: dict) -> None:
        """Copy ``batch`` into the graph's input buffers (made from the first batch)."""
        if self.static is None:
            self.static = {k: v.detach().clone() for k, v in batch.items()}
            return
        if batch.keys() != self.static.keys():
            raise ValueError(f"GraphedStep: batch must hold {sorted(self.static)}, got {sorted(batch)}")
        for k, v in batch.items():
            if v.shape != self.static[k].shape or v.dtype != self.static[k].dtype:
                raise ValueError(f"GraphedStep: batch[{k!r}] must be {tuple(self.static[k].shape)} "
                                 f"{self.static[k].dtype} as at the first step, got {tuple(v.shape)} {v.dtype}")
            self.static[k].copy_(v, non_blocking=True)

    def __call__(self, batch: dict) -> tuple:
        self._take(batch)
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return self.out
        main = torch.cuda.current_stream()
        if self.calls <= self.warmup:
            # eager steps on a side stream, as a capture needs its first calls made (kernels compiled,
            # the optimizer's state made, the allocator's blocks of this step in use once)
            self.stream.wait_stream(main)
            with torch.cuda.stream(self.stream):
                self.optimizer.zero_grad(set_to_none=True)
                out = self._body()
            main.wait_stream(self.stream)
            return out
        # the capture: the gradients are allocated inside it (from the graph's pool) and every replay
        # writes them again, so they are set to None once, here, and never after. torch's optimizers
        # refuse to be captured unless their groups say capturable (their state lives on the device
        # already, made by the eager steps); set here, not at construction, where the eager steps
        # would warn that a capturable optimizer runs uncaptured
        self.optimizer.zero_grad(set_to_none=True)
        for group in self.optimizer.param_groups:
            group["capturable"] = True
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            self.out = self._body()
        self.graph = graph
        graph.replay()  # (a capture records the step's kernels without running them)
        return self.out
