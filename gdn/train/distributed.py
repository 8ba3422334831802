"""torch.distributed plumbing: process group from torchrun's environment, context-parallel groups,
DDP or FSDP2 wrapping, reductions. The only module of the training side that knows about ranks.

With ``context_parallel`` = C, the W ranks form W / C data-parallel groups of C consecutive ranks
(on one node when C divides the GPUs per node): the C ranks of a group train on the same packed
rows, each on its slice of the tokens (:class:`gdn.distributed.ContextParallel`). Parameters,
gradients and optimizer states are replicated (DDP) or sharded (FSDP2) over all W ranks, as
without context parallelism; each rank's loss is its share of its row's mean times C, so that
DDP's / FSDP's mean over W ranks is the mean over the W / C data-parallel rows."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)


@dataclass
class DistInfo:
    """Where this process runs: ``rank`` of ``world_size``, ``device``; ``enabled`` under torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    enabled: bool = False
    cp_size: int = 1  #: ranks sharing one row (context parallelism)
    cp_group: object = None  #: their process group (None without context parallelism)

    @property
    def is_main(self) -> bool:
        """Rank 0 (logs, writes metrics and single-writer files)."""
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Index of this rank's data-parallel group (which rows it trains on)."""
        return self.rank // self.cp_size

    @property
    def dp_size(self) -> int:
        """Number of data-parallel groups (distinct rows per step and micro-batch)."""
        return self.world_size // self.cp_size


def pick_device(pref: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if pref == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if pref == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    return torch.device(pref)


def init(device_pref: str = "auto", context_parallel: int = 1) -> DistInfo:
    """Join the process group when launched by torchrun (``WORLD_SIZE`` > 1): NCCL on CUDA, gloo on CPU;
    with ``context_parallel`` = C > 1, also the groups of C consecutive ranks that share a row."""
    device = pick_device(device_pref)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % context_parallel:
        raise ValueError(f"context_parallel ({context_parallel}) must divide the number of processes ({world})")
    if world <= 1:
        return DistInfo(device=device)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    info = DistInfo(rank, world, local, device, True)
    if context_parallel > 1:
        # every rank creates every group (new_group is collective), then keeps its own
        groups = [dist.new_group(list(range(d * context_parallel, (d + 1) * context_parallel)))
                  for d in range(world // context_parallel)]
        info.cp_size, info.cp_group = context_parallel, groups[rank // context_parallel]
    return info


def wrap(model: nn.Module, strategy: str, info: DistInfo) -> nn.Module:
    """DDP, or FSDP2 (``fully_shard`` on every block, then the root); unchanged when not distributed."""
    if not info.enabled:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(info.device.type, (info.world_size,))
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"distributed must be 'ddp' or 'fsdp', got {strategy!r}")


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP / torch.compile wrappers."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def all_reduce(x: torch.Tensor, op: str = "mean") -> torch.Tensor:
    """Sum/mean/max over ranks (identity when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return x
    ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    dist.all_reduce(x, op=ops[op])
    return x / dist.get_world_size() if op == "mean" else x


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank (a max over ranks through ``device``). Not distributed,
    ``flag`` itself, with no device tensor made or read: reading one back waits for every kernel
    queued before it, which would drain the GPU's queue once a training step."""
    if not (dist.is_available() and dist.is_initialized()):
        return bool(flag)
    return bool(all_reduce(torch.tensor([float(flag)], device=device), "max").item())


def barrier() -> None:
    """Wait for every rank (no-op when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """``obj`` of rank ``src`` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj) -> list:
    """Every rank's ``obj``, in rank order (on every rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def shutdown() -> None:
    """Leave the process group."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
