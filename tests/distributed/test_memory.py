"""Activation memory per rank falls as 1/N with context parallelism: the bytes autograd saves for the
backward during one training forward (``saved_tensors_hooks``, each storage once, parameters not
counted, as benchmarks/memory.py counts them) of gdn-h1 tiny (Gated DeltaNet and sliding-window
attention) on a 2048-token packed row, split over N = 2 and 4 gloo processes, against one process
on the whole row.

On the CPU the recurrent op is the chunk form, which saves its intermediates; the ranks that
continue a sequence also keep the identity-state pass (K value columns beside the layer's V) and
the correction, so they hold up to ~1.45 / N of the one-process bytes (measured 1.44 at N = 2, 1.37
at N = 4; rank 0, which continues nothing, 1.15 and 1.05; docs/CONTEXT_PARALLEL.md).
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from gdn.distributed import ContextParallel
from gdn.models import GDNConfig, GDNForCausalLM

from .helpers import saved_bytes, spawn

T = 2048
CU = [0, 700, 2048]


def _measure(rank, world, path):
    torch.manual_seed(0)
    model = GDNForCausalLM(GDNConfig.from_preset("gdn-h1", "tiny")).train()
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
    cp = ContextParallel.split(dist.group.WORLD, T, CU)
    mine = saved_bytes(lambda: model(input_ids=cp.shard(ids), labels=ids, context_parallel=cp).loss,
                       model.parameters())
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        one = saved_bytes(lambda: model(input_ids=ids, labels=ids, cu_seqlens=torch.tensor(CU)).loss,
                          model.parameters())
        with open(path, "w") as f:
            json.dump({"one": one, "ranks": every}, f)


@pytest.mark.slow  # four training processes on two cores: `make test-all`
def test_activation_memory_per_rank_falls_as_one_over_n(tmp_path):
    got = {}
    for world in (2, 4):
        spawn(_measure, world, str(tmp_path / f"{world}.json"))
        got[world] = json.loads((tmp_path / f"{world}.json").read_text())
    for world, m in got.items():
        for rank, b in enumerate(m["ranks"]):
            assert b * world < 1.5 * m["one"], (world, rank, b * world / m["one"])
    # doubling the ranks halves the largest rank's bytes (within the constant overhead)
    assert max(got[4]["ranks"]) < 0.55 * max(got[2]["ranks"]), (got[2], got[4])
