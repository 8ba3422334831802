"""gdn.ops.offsets: what the ops derive from packed offsets is derived once per offsets tensor, made
again when the tensor is modified in place, and dropped with the tensor; a packed forward of a
model copies its offsets to the host once, whatever its number of layers."""
from __future__ import annotations

import contextlib
import gc
import os
import threading

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from gdn.ops import offsets  # noqa: E402
from gdn.ops.conv import seq_position  # noqa: E402


def test_memo_once_per_tensor_and_version():
    calls = []

    def make():
        calls.append(1)
        return object()

    a = torch.tensor([0, 3, 7])
    b = torch.tensor([0, 3, 7])  # equal values, another tensor: its own entry
    first = offsets.memo(a, "k", make)
    assert offsets.memo(a, "k", make) is first and len(calls) == 1
    assert offsets.memo(b, "k", make) is not first and len(calls) == 2
    assert offsets.memo(a, "other", make) is not first and len(calls) == 3
    a[1] = 4  # an in-place write bumps the version: made again
    assert offsets.memo(a, "k", make) is not first and len(calls) == 4
    key = id(a)
    del a
    gc.collect()
    assert key not in offsets._MEMO  # dropped with the tensor


def test_host_copy_and_positions_follow_the_values():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    h = offsets.host(cu)
    assert h.dtype == torch.int64 and h.tolist() == [0, 2, 5] and offsets.host(cu) is h
    pos, seq = seq_position(cu, 5)
    assert pos.tolist() == [0, 1, 0, 1, 2] and seq.tolist() == [0, 0, 1, 1, 1]
    assert seq_position(cu, 5)[0] is pos
    cu[1] = 3
    assert offsets.host(cu).tolist() == [0, 3, 5]
    assert seq_position(cu, 5)[0].tolist() == [0, 1, 2, 0, 1]


def test_chunk_layout_made_once_per_offsets_tensor():
    pytest.importorskip("triton")
    from gdn.ops.triton.common import make_chunks

    cu = torch.tensor([0, 70, 200], dtype=torch.int32)
    ch = make_chunks(1, 200, cu, torch.device("cpu"))
    assert make_chunks(1, 200, cu, torch.device("cpu")) is ch
    assert (ch.N, ch.NT, ch.max_nc) == (2, 2 + 3, 3)
    cu[1] = 130
    ch2 = make_chunks(1, 200, cu, torch.device("cpu"))
    assert ch2 is not ch and (ch2.NT, ch2.max_nc) == (3 + 2, 3)


class _Reads(TorchDispatchMode):
    """Counts the aten ops that take (a view of) the tensor ``t`` as an argument, and its
    ``tolist()`` calls (which read memory without an aten op)."""

    def __init__(self, t):
        super().__init__()
        self.ptr, self.n = t.untyped_storage().data_ptr(), 0

    def reads(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() == self.ptr

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(self.reads(a) for a in list(args) + list((kwargs or {}).values())):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _packed_forward_reads(layers: int, monkeypatch) -> int:
    from gdn.models import GDNConfig, GDNForCausalLM

    cfg = GDNConfig.from_preset("gdn-h1", "tiny", num_hidden_layers=layers)  # Gated DeltaNet and attention
    model = GDNForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 40, 96], dtype=torch.int32)
    counter = _Reads(cu)
    tolist = torch.Tensor.tolist

    def counted(self):
        if counter.reads(self):
            counter.n += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    with torch.no_grad(), counter:
        model(input_ids=ids, cu_seqlens=cu)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return counter.n


def test_packed_forward_reads_the_offsets_a_fixed_number_of_times(monkeypatch):
    """On the Triton path of a hybrid model (kernels launched as no-ops: only the host work
    runs), the ops touch the offsets tensor as often for 4 layers as for 2: the host copy (a device
    synchronisation on a GPU), the chunk layout and the positions are made once per forward."""
    pytest.importorskip("triton")
    from gdn.ops.tuning import INTERPRET

    if not INTERPRET:
        pytest.skip("triton was imported without TRITON_INTERPRET")
    import triton.runtime.interpreter as interp

    from gdn.ops import conv, loss, norm, router, swiglu

    monkeypatch.setattr(interp.InterpretedFunction, "__getitem__", lambda self, grid: (lambda *a, **k: None))
    for module in (router, norm, conv, swiglu, loss):
        monkeypatch.setattr(module, "use_triton", lambda x: True)
    two, four = _packed_forward_reads(2, monkeypatch), _packed_forward_reads(4, monkeypatch)
    assert 0 < two == four, (two, four)


def test_offsets_moved_to_a_device_keep_their_host_copy():
    """to_device records the host values with the device copy: host() returns them without reading
    the device tensor (here the meta device, which holds no values to read)."""
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    moved = offsets.to_device(cu, "meta")
    assert moved.device.type == "meta" and offsets.host(moved).tolist() == [0, 4, 9]
    assert offsets.to_device(cu, "cpu") is cu  # already there: the same tensor


def test_a_kept_result_made_from_another_does_not_wait_on_itself(monkeypatch):
    """With CUDA up, lasting() runs its make on a helper thread; a make that needs another kept
    result (a packed chunk layout from the offsets' host copy) runs that one in place instead of
    queueing it behind itself on the one helper."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    threads, got = [], []

    def inner():
        threads.append(threading.current_thread())
        return 3

    def outer():
        threads.append(threading.current_thread())
        return offsets.lasting(inner) + 1

    caller = threading.Thread(target=lambda: got.append(offsets.lasting(outer)), daemon=True)
    caller.start()
    caller.join(10)
    assert got == [4], "lasting() nested in a lasting() make never returned"
    assert threads[0] is threads[1] is not caller  # both on the helper thread


def test_a_capture_reads_the_host_copy_made_before_it(monkeypatch):
    """While a CUDA graph captures (stood in for: ``_capturing`` true), the host copy comes from the
    eager call before, not from a copy to the host (which a capture cannot make); without one, or
    after the offsets were modified since, the call is refused with one line naming cu_seqlens."""
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    before = offsets.host(cu)
    monkeypatch.setattr(offsets, "_capturing", lambda t: True)
    real_to = torch.Tensor.to

    def no_copy(self, *args, **kw):
        raise AssertionError("a copy while capturing")

    monkeypatch.setattr(torch.Tensor, "to", no_copy)
    assert offsets.host(cu) is before
    monkeypatch.setattr(torch.Tensor, "to", real_to)
    fresh = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        offsets.host(fresh)
    cu.add_(0)  # modified in place: its kept copy no longer stands
    with pytest.raises(ValueError, match="cu_seqlens"):
        offsets.host(cu)
