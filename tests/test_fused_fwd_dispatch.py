"""Which kernels the gated delta rule launches on a Hopper card with the warp-specialised pass
(gdn.ops.delta.triton.fused_fwd), recorded on the CPU (gdn.ops.triton.launch.recording: nothing runs;
the card's 132 multiprocessors assumed, as tools/sass_cpu.py does): the forward takes it with the
pair matrix formed there (kkt_solve stores none), the backward's recomputed state pass takes it
storing h and δ, sequences that would leave multiprocessors idle run as warm-started segments
(warm_plan first), value heads of 256 run as two programs of 128-wide value tiles, and the calls it
does not take (K = 256, fp32) keep the Triton passes. The kernel's results are checked on the GPU
(tests/gpu/test_fused_fwd.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from gdn.ops.delta.triton import chunk, chunk_bwd, chunk_fwd, fused_bwd, fused_fwd, fused_rbwd, fused_rev, split  # noqa: E402
from gdn.ops import tuning  # noqa: E402
from gdn.ops.triton import common  # noqa: E402
from gdn.ops.triton import launch as launcher  # noqa: E402

SMS = 132


@pytest.fixture
def hopper(monkeypatch):
    """Launches as on a Hopper card for the forward's pass (its device rule true; the backward's
    Gluon passes keep theirs), 132 multiprocessors."""
    monkeypatch.setattr(fused_fwd, "hopper", lambda q: True)  # (fused_bwd.hopper, as fused_fwd imports it)
    for mod in (launcher, common, chunk, chunk_fwd, chunk_bwd, split, fused_rev):
        if hasattr(mod, "sm_count"):
            monkeypatch.setattr(mod, "sm_count", lambda device: SMS)


def _record(B, T, H, HV, K, V, dtype=torch.bfloat16, h0=False, plans=None):
    """The launches (kernel, grid, args, meta) of one forward and of its backward (``h0``: with an
    initial state and a final-state gradient; ``plans``: the call's warm-up counts handed from the
    forward to the backward, as the autograd node hands them)."""
    q = torch.empty(B * T, H, K, dtype=dtype)
    k, v = torch.empty_like(q), torch.empty(B * T, HV, V, dtype=dtype)
    g, beta = torch.zeros(B * T, HV), torch.zeros(B * T, HV)
    s0 = torch.zeros(B, HV, K, V) if h0 else None
    ch = common.make_chunks(B, T, None, torch.device("cpu"))
    with launcher.recording() as fwd:
        _, _, ai, gam = chunk._forward(q, k, v, g, beta, s0, ch, False, K ** -0.5, dtype, plans=plans)
    with launcher.recording() as bwd:
        chunk_bwd.backward(q, k, v, g, beta, s0, v, s0, ch, K ** -0.5, ai, dtype, gam, plans=plans)
    return fwd, bwd


def _names(launches):
    return [kernel.fn.__name__ for kernel, _, _, _ in launches]


def _meta(launches, name):
    return [(grid, meta) for kernel, grid, _, meta in launches if kernel.fn.__name__ == name]


def _args(launches, name):
    """{argument name: value} of each launch of kernel ``name``."""
    return [dict(zip(kernel.arg_names, args)) | meta for kernel, _, args, meta in launches
            if kernel.fn.__name__ == name]


def test_whole_sequences_take_the_warp_specialised_passes(hopper):
    fwd, bwd = _record(8, 2048, 16, 16, 128, 128)
    assert _names(fwd) == ["kkt_solve_kernel", "fused_fwd_kernel"], _names(fwd)
    (_, kkt), = _meta(fwd, "kkt_solve_kernel")
    assert not kkt["STORE_P"]  # the pass forms the pair matrix itself
    (grid, meta), = _meta(fwd, "fused_fwd_kernel")
    assert grid == (8 * 16,) and meta["OUT"] and not meta["STORE_H"] and not meta["WARM"], (grid, meta)
    names = _names(bwd)
    assert "state_fwd_kernel" not in names and "state_out_kernel" not in names, names
    (grid, meta), = _meta(bwd, "fused_fwd_kernel")
    assert grid == (8 * 16,) and not meta["OUT"] and meta["STORE_H"], (grid, meta)


def test_few_long_sequences_run_as_segments(hopper):
    """1 × 32768 at 16 heads: 16 programs would leave the card idle; segments give at most one
    program a multiprocessor (this program's shared memory takes a whole one), each warm-up count
    from warm_plan."""
    fwd, bwd = _record(1, 32768, 16, 16, 128, 128)
    for launches in (fwd, bwd):
        names = _names(launches)
        assert names.index("warm_plan_kernel") < names.index("fused_fwd_kernel"), names
        (grid, meta), = _meta(launches, "fused_fwd_kernel")
        assert meta["WARM"] and SMS // 2 < grid[0] <= SMS, (grid, meta)


@pytest.mark.parametrize("V", [128, 256])
def test_the_backward_takes_the_forwards_warm_up_counts(hopper, V):
    """With the call's plans handed on (ChunkFunction keeps them on its context), the backward's
    recomputed state pass reads the warm-up counts the forward's pass walked (the same k, β and γ)
    instead of launching warm_plan again: one walk before the segments a forward + backward. Every
    walk adds up the chunks' bounds that the forward's kkt_solve stored (no kernel reads the keys
    for them again)."""
    plans = {}
    fwd, bwd = _record(1, 32768, 16, 16, 128, V, plans=plans)
    bound = plans.pop("bound")
    (plan,) = plans.values()
    assert _names(fwd).count("warm_plan_kernel") == 1 and "warm_plan_kernel" not in _names(bwd), _names(bwd)
    (f,) = _args(fwd, "fused_fwd_kernel")
    (b,) = _args(bwd, "fused_fwd_kernel")
    assert f["plan"] is plan and b["plan"] is plan and b["WARM"] and b["STORE_H"]
    (kkt,) = _args(fwd, "kkt_solve_kernel")
    assert kkt["STORE_B"] and kkt["Bnd"] is bound
    walks = _args(fwd, "warm_plan_kernel") + [a for a in _args(bwd, "state_bwd_kernel") if a.get("WARM")]
    assert len(walks) == 2 and all(w["Bnd"] is bound and w["DELTA"] for w in walks), _names(bwd)
    assert "bound_kernel" not in _names(fwd) + _names(bwd)


def test_autograd_node_hands_the_counts_to_its_backward(hopper, monkeypatch):
    """chunk_op through autograd: the plans its forward filled reach its backward."""
    seen = []

    def spy(*args):
        seen.append(args[-1])
        raise RuntimeError("stop")  # (nothing runs on the CPU: the handover is what is checked)

    monkeypatch.setattr(chunk_bwd, "backward", spy)
    q = torch.zeros(1, 32768, 16, 128, dtype=torch.bfloat16, requires_grad=True)
    g, beta = torch.zeros(1, 32768, 16), torch.zeros(1, 32768, 16)
    with launcher.recording():
        o, _ = chunk.chunk_op(q, q, q, g, beta)
    with pytest.raises(RuntimeError, match="stop"), launcher.recording():
        o.float().sum().backward()
    (plans,) = seen
    assert isinstance(plans, dict) and "bound" in plans and len(plans) == 2, plans


@pytest.mark.parametrize("K, V, dtype", [(128, 128, torch.float32), (256, 128, torch.bfloat16),
                                         (256, 256, torch.bfloat16)])
def test_calls_it_does_not_take_keep_the_triton_passes(hopper, K, V, dtype):
    fwd, bwd = _record(2, 256, 2, 2, K, V, dtype)
    assert "fused_fwd_kernel" not in _names(fwd) + _names(bwd)
    assert "state_fwd_kernel" in _names(bwd)


def test_value_heads_of_256_run_as_two_value_tiles(hopper):
    """V = 256 (the 340m layer): one program per (sequence, value head, 128-wide value tile), the
    two tiles of a head neighbours in the grid; v read and h written in [64, 128] and [K, 128]
    blocks of the whole [·, V]-wide rows."""
    B, T, HV, K, V = 8, 2048, 16, 128, 256
    fwd, bwd = _record(B, T, 16, HV, K, V)
    (grid, meta), = _meta(fwd, "fused_fwd_kernel")
    assert grid == (B * HV * 2,) and meta["OUT"] and not meta["WARM"], (grid, meta)
    assert (meta["V"], meta["VT"]) == (256, 128), meta
    a, = _args(fwd, "fused_fwd_kernel")
    assert a["v_t"].block_shape == [64, 128] and list(a["v_t"].shape) == [B * T, HV * V], a["v_t"]
    (grid, meta), = _meta(bwd, "fused_fwd_kernel")
    assert grid == (B * HV * 2,) and meta["STORE_H"] and not meta["OUT"], (grid, meta)
    a, = _args(bwd, "fused_fwd_kernel")
    assert a["v_t"].block_shape == [64, 128], a["v_t"]
    # h: every sequence's 32 states, then the free rows its first slice's dS_out go to (share_h: the
    # 256 MiB of dS_out over the 44 MiB budget run in slices of 8, 16 and 8 chunks: 8 rows a sequence)
    rows = B * T // 64 + (B * 8 if tuning.DELTA["state_bwd"]["share_h"] else 0)
    assert a["h_t"].block_shape == [K, 128] and list(a["h_t"].shape) == [rows * HV * K, V], a["h_t"]


def test_value_heads_of_256_split_counting_every_tile(hopper):
    """1 × 32768 at 16 heads of V = 256: 32 programs; the segments keep at most one program a
    multiprocessor counting both value tiles, and warm_plan runs once per (segment, head), its
    counts shared by the head's value tiles."""
    fwd, bwd = _record(1, 32768, 16, 16, 128, 256)
    for launches in (fwd, bwd):
        (plan_grid, _), = _meta(launches, "warm_plan_kernel")
        (grid, meta), = _meta(launches, "fused_fwd_kernel")
        assert meta["WARM"] and SMS // 2 < grid[0] <= SMS, (grid, meta)
        assert grid[0] == plan_grid[0] * plan_grid[1] * 2 and plan_grid[1] == 16, (grid, plan_grid)


def test_usable_value_widths(hopper):
    q = torch.empty(4, 2, 128, dtype=torch.bfloat16)
    g = beta = torch.zeros(4, 2)
    for V in (64, 128, 256):
        assert fused_fwd.usable(q, g, beta, 128, V) and fused_fwd.usable(q, g, beta, 64, V), V
    for K, V in ((128, 32), (128, 512), (128, 192), (256, 128), (32, 128)):
        assert not fused_fwd.usable(q, g, beta, K, V), (K, V)
    assert fused_fwd.value_tile(64) == 64 and fused_fwd.value_tile(128) == fused_fwd.value_tile(256) == 128


def test_off_switches(hopper, monkeypatch):
    from gdn.ops import tuning

    monkeypatch.setitem(tuning.DELTA, "fused_fwd", dict(tuning.DELTA["fused_fwd"], on=False))
    fwd, bwd = _record(8, 2048, 16, 16, 128, 128)
    assert "fused_fwd_kernel" not in _names(fwd) and "fused_fwd_kernel" in _names(bwd)
    (_, kkt), = _meta(fwd, "kkt_solve_kernel")
    assert kkt["STORE_P"]  # state_out reads kkt_solve's pair matrix
    monkeypatch.setitem(tuning.DELTA, "fused_states", dict(tuning.DELTA["fused_states"], on=False))
    _, bwd = _record(8, 2048, 16, 16, 128, 128)
    assert "fused_fwd_kernel" not in _names(bwd) and "state_fwd_kernel" in _names(bwd)


@pytest.fixture
def h200(monkeypatch):
    """Every device rule as on the H200: the three Gluon passes' Hopper tests, 132 multiprocessors."""
    for mod in (fused_fwd, fused_rev, fused_bwd, fused_rbwd):
        monkeypatch.setattr(mod, "hopper", lambda q: True)
    for mod in (launcher, common, chunk, chunk_fwd, chunk_bwd, split, fused_rev):
        if hasattr(mod, "sm_count"):
            monkeypatch.setattr(mod, "sm_count", lambda device: SMS)


@pytest.mark.parametrize("T, H, HV, K, V, lens, state", [
    (1, 2, 4, 128, 128, None, True),  # one token
    (65, 1, 1, 64, 64, None, False),  # a partial second chunk
    (200, 2, 8, 128, 256, [0, 0, 70, 0, 130], True),  # empty sequences around packed ones, V = 256
    (4100, 4, 16, 128, 128, [1, 4000, 99], True),  # grouped heads; one long sequence splits
    (33000, 16, 16, 128, 128, None, False),  # few long sequences: warm-started segments, sliced
    (9000, 16, 64, 128, 128, [9000], True),  # Qwen3.5-397B's head layout
])
def test_awkward_calls_take_the_h200_path_end_to_end(h200, T, H, HV, K, V, lens, state):
    """A forward + backward through autograd at awkward shapes, every launch recorded on the H200's
    path (nothing runs): its host side (chunk layout, splits, slices, descriptors, the warm-up
    counts handed on) raises nothing, every grid is non-empty, the Gluon passes take the call and
    the gradients come back in their inputs' shapes."""
    names = set(_end_to_end(T, H, HV, K, V, lens, state))
    assert {"fused_fwd_kernel", "fused_rev_kernel", "fused_bwd_kernel"} <= names, names


def _end_to_end(T, H, HV, K, V, lens, state, keep=None) -> list:
    """The kernels a bf16 forward + backward through autograd launches (recorded, nothing runs),
    having checked that every grid is non-empty and every input got a gradient of its shape; the
    launches themselves appended to ``keep`` where given."""
    B = 1 if lens else 2
    cu = None if lens is None else torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    N = len(lens) if lens else B
    q = torch.zeros(B, T, H, K, dtype=torch.bfloat16, requires_grad=True)
    k = torch.zeros(B, T, H, K, dtype=torch.bfloat16, requires_grad=True)
    v = torch.zeros(B, T, HV, V, dtype=torch.bfloat16, requires_grad=True)
    g = torch.zeros(B, T, HV, requires_grad=True)
    beta = torch.zeros(B, T, HV, requires_grad=True)
    h0 = torch.zeros(N, HV, K, V, requires_grad=True) if state else None
    with launcher.recording() as launches:
        o, ht = chunk.chunk_op(q, k, v, g, beta, initial_state=h0, output_final_state=state, cu_seqlens=cu)
        (o.float().sum() + (ht.sum() if state else 0)).backward()
    assert all(d > 0 for _, grid, _, _ in launches for d in grid), [(_names([x]), x[1]) for x in launches]
    for x in (q, k, v, g, beta) + ((h0,) if state else ()):
        assert x.grad is not None and x.grad.shape == x.shape
    if keep is not None:
        keep.extend(launches)
    return _names(launches)


@pytest.mark.parametrize("T, H, HV, lens, state", [
    (1, 2, 4, None, True),  # one token
    (4100, 4, 16, [1, 4000, 99], True),  # grouped heads; one long sequence splits
    (33000, 16, 16, None, False),  # few long sequences: warm-started segments
])
def test_merged_backward_takes_the_h200_path(h200, monkeypatch, T, H, HV, lens, state):
    """With ``DELTA["fused_rbwd"]`` on, a forward + backward at K = V = 128 on the H200's path
    (recorded, nothing runs) launches the merged backward once instead of the reverse pass and the
    per-chunk kernel (whole sequences or warm-started segments: no slices), and the gradients come
    back in their inputs' shapes; dV is written over δ (bf16 both), so no buffer of its own."""
    monkeypatch.setitem(tuning.DELTA, "fused_rbwd", dict(tuning.DELTA["fused_rbwd"], on=True))
    launches = []
    names = _end_to_end(T, H, HV, 128, 128, lens, state, keep=launches)
    assert names.count("fused_rbwd_kernel") == 1 and "fused_rev_kernel" not in names, names
    assert "fused_bwd_kernel" not in names, names
    (args,) = [a for kern, _, a, _ in launches if kern.fn.__name__ == "fused_rbwd_kernel"]
    names_in = fused_rbwd.fused_rbwd_kernel.arg_names
    d_t, dv = args[names_in.index("d_t")], args[names_in.index("DV")]
    assert dv.data_ptr() == d_t.base.data_ptr() and dv.dtype == d_t.base.dtype
