"""gdn.ops.triton.launch.run: the first launch of a specialisation goes through Triton's path and
the compiled kernel it returns is kept; later launches with the same specialisation (Triton's own
binder decides it) call that kernel's launcher directly, with the bound arguments, the grid padded
to three dimensions and the current stream; a new specialisation, a launch hook or an unhashable
specialisation goes through Triton's path again. Faked kernel and device: the real path needs CUDA
(tests/gpu runs every chunk kernel through it)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402

from gdn.ops.triton import launch as L  # noqa: E402


class Compiled:
    def __init__(self):
        self.function, self.packed_metadata, self.direct = "fn", "meta", []

    def run(self, *a):
        self.direct.append(a)


class Kernel:
    """A JIT function's surface as :func:`run` uses it: ``device_caches[dev][4]`` (the binder) and
    ``kernel[grid](*args, **kw)`` (Triton's path, which compiles once per specialisation)."""

    def __init__(self):
        self.device_caches = {0: (None, None, None, None, self.bind)}
        self.via_triton, self.compiled = [], {}

    @staticmethod
    def bind(*args, **kw):
        """(every parameter's value, the specialisation, the options) as Triton's binder gives them."""
        spec = [("*bf16", "D") if isinstance(a, torch.Tensor) else ("i32", "D" if a % 16 == 0 else None)
                for a in args]
        params = {k: v for k, v in kw.items() if not k.startswith("num_")}
        return {**{f"a{i}": a for i, a in enumerate(args)}, **params}, spec, {"num_warps": kw.get("num_warps")}

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.via_triton.append((grid, args))
            return self.compiled.setdefault(str(self.device_caches[0][4](*args, **kw)[1]), Compiled())
        return launch


@pytest.fixture
def cuda_like(monkeypatch):
    monkeypatch.setattr(L, "INTERPRET", False)
    monkeypatch.setattr(L, "_LAUNCHERS", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(L, "_stream", lambda dev: 77)


def test_first_launch_compiles_through_triton_then_the_launcher_runs_directly(cuda_like):
    k, x = Kernel(), torch.zeros(4)
    ck = L.run(k, (3, 2), (x, 32), {"BV": 64, "num_warps": 4}, key=("k",))
    assert len(k.via_triton) == 1 and ck.direct == []
    assert L.run(k, (5,), (x, 48), {"BV": 64, "num_warps": 4}, key=("k",)) is ck  # same specialisation
    assert len(k.via_triton) == 1
    assert ck.direct == [(5, 1, 1, 77, "fn", "meta", None, None, None, x, 48, 64)]
    L.run(k, (5,), (x, 7), {"BV": 64, "num_warps": 4}, key=("k",))  # 7: another specialisation
    assert len(k.via_triton) == 2 and len(ck.direct) == 1


def test_launch_hooks_and_interpreter_take_tritons_path(cuda_like, monkeypatch):
    k, x = Kernel(), torch.zeros(4)
    L.run(k, (1,), (x, 16), {}, key=("k",))
    hook = lambda *a: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        L.run(k, (1,), (x, 16), {}, key=("k",))
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    monkeypatch.setattr(L, "INTERPRET", True)
    L.run(k, (1,), (x, 16), {}, key=("k",))
    assert len(k.via_triton) == 3 and all(not c.direct for c in k.compiled.values())


def test_unhashable_specialisation_takes_tritons_path(cuda_like, monkeypatch):
    k, x = Kernel(), torch.zeros(4)
    monkeypatch.setattr(k, "bind", lambda *a, **kw: ({}, [("tensordesc", [64, 32])], {}))
    k.device_caches = {0: (None, None, None, None, k.bind)}
    for _ in range(2):
        L.run(k, (1,), (x,), {}, key=("k",))
    assert len(k.via_triton) == 2


class Launcher:
    """Triton 3.6's CudaLauncher as :func:`L._launcher` reads it: the C ``launch`` and its flags."""

    def __init__(self, scratch=0):
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.c_calls, self.py_calls = [], []

    def launch(self, *a):
        self.c_calls.append(a)

    def __call__(self, *a):
        self.py_calls.append(a)


@pytest.mark.parametrize("scratch", [0, 64])
def test_launcher_without_scratch_is_called_in_c(cuda_like, monkeypatch, scratch):
    """A compiled kernel whose launcher needs no scratch memory is launched by the launcher's C
    function (grid, stream, function, flags, no scratch, then the launcher call's own arguments);
    one that needs scratch through the launcher's call, which allocates it."""
    monkeypatch.setattr(L, "_DIRECT_LAYOUT", True)
    k, x = Kernel(), torch.zeros(4)
    ck = L.run(k, (3,), (x, 32), {"num_warps": 4}, key=("k",))
    ck.run = Launcher(scratch)
    L._LAUNCHERS.clear()
    L.run(k, (3,), (x, 32), {"num_warps": 4}, key=("k",))  # found in Triton's cache: kept with its launcher
    L.run(k, (2, 5), (x, 48), {"num_warps": 4}, key=("k",))
    if scratch:
        assert ck.run.c_calls == [] and ck.run.py_calls == [(2, 5, 1, 77, "fn", "meta", None, None, None, x, 48)]
    else:
        assert ck.run.py_calls == []
        assert ck.run.c_calls == [(2, 5, 1, 77, "fn", False, True, None, None, "meta", None, None, None, x, 48)]
