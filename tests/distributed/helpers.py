"""Run a function on N CPU processes (gloo) with torch.multiprocessing.spawn."""
from __future__ import annotations

import gc
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, init_file, fn, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # gloo's connect can return on one rank while a peer is still handshaking; a rank that ran
        # ahead and tore its group down would close that handshake: meet before and after fn
        dist.barrier()
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        # spawn reports one process's error, often a peer's "connection closed": print each rank's own
        traceback.print_exc()
        raise
    finally:
        # the body's objects that hold the group (a ContextParallel kept by an autograd context) can
        # sit in reference cycles: collect them, so that the group is torn down here and not by a
        # destructor at interpreter exit, after the threads it joins may be gone
        gc.collect()
        dist.destroy_process_group()


def spawn(fn, world: int, *args) -> None:
    """``fn(rank, world, *args)`` on ``world`` processes joined in a gloo group; an exception in any
    of them fails the caller (``fn`` must be importable: a module-level function)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, os.path.join(tmp, "rendezvous"), fn, args), nprocs=world, join=True)


def saved_bytes(fn, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn()`` runs, leaving out
    the storages of the tensors in ``exclude`` (e.g. a model's parameters, which every rank holds)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total
