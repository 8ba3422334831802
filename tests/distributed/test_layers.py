"""Every mixer runs context-parallel: a model whose layers are every letter (Gated DeltaNet, DeltaNet,
gated linear attention, linear attention, KDA, global and sliding-window attention, with short
convolutions and grouped value heads), split over 2 and 4 gloo processes, equals the one-process
model in fp64: each mixer alone (output, input and parameter gradients) to 1e-10 (1e-6 for DeltaNet
and KDA, which keep β and an output norm in fp32 by design); the whole stack's hidden states, loss
and gradients to 1e-6 (those fp32 parts, and the head's cross entropy works in fp32; a wrong halo,
position or state is off by 1e-1), also with activation checkpointing (the backward recomputes the
blocks and their collectives); batch rows and packed sequences crossing rank boundaries; a window shorter than a slice (the halo
from the previous rank) and longer (gathered from several ranks); the model and its layers reject
what context parallelism does not take.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gdn.distributed import ContextParallel
from gdn.layers import Attention, ShortConvolution
from gdn.models import GDNConfig, GDNForCausalLM

from ..ops.helpers import rel_err
from .helpers import spawn

T_TOTAL = 40
LAYOUTS = [("rows", None, 2), ("packed", [0, 3, 3, 17, 18, 40], 1)]


def _model(window):
    torch.manual_seed(0)
    cfg = GDNConfig(vocab_size=64, hidden_size=32, num_hidden_layers=7, layer_pattern="GDMLKAS", num_heads=2,
                    head_dim=8, num_v_heads=4, expand_v=1.0, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, window_size=window, conv_size=4, initializer_range=0.2)
    return GDNForCausalLM(cfg).double().train()


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _compare(failures, where, got, ref, tol, what):
    for name, g in got.items():
        dist.all_reduce(g)
        e = rel_err(g, ref[name])
        if not e < tol:
            failures.append(f"{where}: {what} d{name} error {e:.2e}")
    if set(got) != set(ref):
        failures.append(f"{where}: {what} gradients of {sorted(set(ref) ^ set(got))} on one side only")


#: Tolerance of each mixer alone in fp64: DeltaNet keeps β and KDA its output norm in fp32 by design
#: (a rounding of x·W_b to fp32 can differ by one ulp between the split and the whole sequence).
TOL = {"G": 1e-10, "M": 1e-10, "L": 1e-10, "A": 1e-10, "S": 1e-10, "D": 1e-6, "K": 1e-6}


def _check_mixers(rank, world, window):
    """Each mixer alone on the same input: output, input gradient and parameter gradients."""
    failures = []
    model = _model(window)
    for lname, cu, B in LAYOUTS:
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        cp = ContextParallel.split(dist.group.WORLD, T_TOTAL, cu)
        gen = torch.Generator().manual_seed(2)
        x, dy = (torch.randn(B, T_TOTAL, 32, generator=gen, dtype=torch.float64) for _ in range(2))
        for letter, block in zip(model.config.layer_pattern, model.model.layers):
            mixer = block.mixer
            where = f"{letter} {lname} window {window} rank {rank}/{world}"
            mixer.zero_grad()
            xr = x.clone().requires_grad_(True)
            y_ref = mixer(xr, cu_seqlens=cu_t)[0]
            (y_ref * dy).sum().backward()
            ref = _grads(mixer)
            mixer.zero_grad()
            xl = cp.shard(x).clone().requires_grad_(True)
            y = mixer(xl, context_parallel=cp)[0]
            (y * cp.shard(dy)).sum().backward()
            for what, a, b in (("output", y, cp.shard(y_ref)), ("dx", xl.grad, cp.shard(xr.grad))):
                e = rel_err(a, b)
                if not e < TOL[letter]:
                    failures.append(f"{where}: {what} error {e:.2e}")
            _compare(failures, where, _grads(mixer), ref, TOL[letter], "mixer")
    return failures


def _check(rank, world, window):
    failures = _check_mixers(rank, world, window)
    for lname, cu, B in LAYOUTS:
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 64, (B, T_TOTAL), generator=gen)
        dh = torch.randn(B, T_TOTAL, 32, generator=gen, dtype=torch.float64)
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        cp = ContextParallel.split(dist.group.WORLD, T_TOTAL, cu)
        where = f"{lname} window {window} rank {rank}/{world}"
        # the stack: every layer's output and every parameter's gradient of Σ h·dh (fp32 numbers inside
        # D and K layers, see TOL)
        ref, model = _model(window), _model(window)
        out = ref.model(input_ids=ids, cu_seqlens=cu_t, output_hidden_states=True, use_cache=False)
        (out.last_hidden_state * dh).sum().backward()
        got = model.model(input_ids=cp.shard(ids), context_parallel=cp, output_hidden_states=True)
        (got.last_hidden_state * cp.shard(dh)).sum().backward()
        for i, (h, h_ref) in enumerate(zip(got.hidden_states, out.hidden_states)):
            e = rel_err(h, cp.shard(h_ref))
            if not e < 1e-6:
                failures.append(f"{where}: hidden state {i} error {e:.2e}")
        _compare(failures, where, _grads(model), _grads(ref), 1e-6, "stack")
        # the language-model loss: labels of the whole sequence, shifted across rank boundaries; the
        # head's cross entropy runs in fp32 (gdn.ops.loss; in eval mode on fp32 logits)
        ref, model = _model(window), _model(window)
        model.model.gradient_checkpointing = True  # the backward recomputes blocks: their collectives too
        out = ref(input_ids=ids, labels=ids, cu_seqlens=cu_t)
        out.loss.backward()
        got = model(input_ids=cp.shard(ids), labels=ids, context_parallel=cp)
        got.loss.backward()
        loss = got.loss.detach().clone()
        dist.all_reduce(loss)
        if not rel_err(loss, out.loss) < 1e-6:
            failures.append(f"{where}: loss {float(loss)} vs {float(out.loss)}")
        _compare(failures, where, _grads(model), _grads(ref), 1e-6, "loss")
        # eval mode: the loss from full logits, in fp64
        with torch.no_grad():
            ref.eval(), model.eval()
            want = ref(input_ids=ids, labels=ids, cu_seqlens=cu_t).loss
            have = model(input_ids=cp.shard(ids), labels=ids, context_parallel=cp).loss.clone()
            dist.all_reduce(have)
            if not rel_err(have, want) < 1e-6:
                failures.append(f"{where}: eval loss {float(have)} vs {float(want)}")
    return failures


def _worker(rank, world, windows):
    mine = [f for w in windows for f in _check(rank, world, w)]
    failures = [None] * world
    dist.all_gather_object(failures, mine)
    failures = [f for per_rank in failures for f in per_rank]
    assert not failures, "\n".join(failures)


def test_two_processes():
    """2 ranks of 20 tokens: windows 8 (halo from the previous rank) and 32 (reaches two ranks back,
    through rank 0's zeros)."""
    spawn(_worker_then_rejects, 2, [8, 32])


@pytest.mark.slow  # four processes on two cores: `make test-all`
def test_four_processes():
    """4 ranks of 10 tokens: window 8 (one hop) and 25 (the halo gathered from up to three ranks)."""
    spawn(_worker, 4, [8, 25])


def _rejects(rank, world):
    cp = ContextParallel.split(dist.group.WORLD, 8)
    x = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="context_parallel"):
        ShortConvolution(16)(x, mask=torch.ones(1, 4), context_parallel=cp)
    with pytest.raises(ValueError, match="context_parallel"):
        Attention(16, 2)(x, use_cache=True, context_parallel=cp)
    model = _model(8)
    with pytest.raises(ValueError, match="context_parallel"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4]), context_parallel=cp)
    with pytest.raises(ValueError, match="tokens"):
        model(input_ids=torch.zeros(1, 5, dtype=torch.long), context_parallel=cp)
    with pytest.raises(ValueError, match="labels"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long),
              context_parallel=cp)


def _worker_then_rejects(rank, world, arg):
    """The two-process run, then the inputs it must refuse (one spawn for both: a spawn costs ~10 s
    of imports on two cores)."""
    _worker(rank, world, arg)
    _rejects(rank, world)
