"""gdn.ops.triton.launch.run: the first launch of a specialisation goes through Triton's path and
the compiled kernel it returns is kept; later launches with the same specialisation (launch._arg_key
of every parameter, at least as fine as Triton's own) call that kernel's launcher directly, with
every parameter's value, the grid padded to three dimensions and the current stream; a new
specialisation, a launch hook or an argument of an unknown kind goes through Triton's path again.
Faked kernel and device: the real path needs CUDA (tests/gpu runs every chunk kernel through it);
the keys are checked against Triton's own specialisation (native_specialize_impl) on the CPU."""
from __future__ import annotations

import copy
import inspect

import numpy as np
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


class Param:
    def __init__(self, name, constexpr=False, default=inspect.Parameter.empty):
        self.name, self.is_constexpr, self.default = name, constexpr, default


class Kernel:
    """A JIT function's surface as :func:`run` uses it: ``params`` (name, default, whether a
    compile-time constant), ``device_caches`` and ``kernel[grid](*args, **kw)`` (Triton's path,
    which compiles once per specialisation)."""

    def __init__(self):
        self.device_caches = {}
        self.params = [Param("a0"), Param("a1"), Param("BV", True, 16)]
        self.via_triton, self.compiled = [], {}

    @staticmethod
    def spec(*args, **kw):
        """Triton's specialisation of these parameters."""
        return [("*bf16", "D") if isinstance(a, torch.Tensor) else ("i32", "D" if a % 16 == 0 else None)
                for a in args] + [kw.get("BV", 16)]

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.via_triton.append((grid, args))
            return self.compiled.setdefault(str(self.spec(*args, **kw)), Compiled())
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
    assert ck.direct == [(5, 1, 1, 77, "fn", "meta", None, None, None, x.data_ptr(), 48, 64)]
    L.run(k, (5,), (x, 7), {"BV": 64, "num_warps": 4}, key=("k",))  # 7: another specialisation
    assert len(k.via_triton) == 2 and len(ck.direct) == 1


def test_launcher_gets_each_tensors_address_in_its_place(cuda_like):
    """Later launches hand the launcher each tensor's address (Triton's C launcher would call the
    tensor's data_ptr and ask the driver about the address, per tensor and launch); ints, floats
    and the rest pass as they are, and a tensor view passes its own address (storage offset in)."""
    k, x = Kernel(), torch.zeros(64)
    k.params = [Param("a0"), Param("n"), Param("a1"), Param("s"), Param("BV", True, 16)]
    L.run(k, (1,), (x, 16, x[8:], 0.5), {}, key=("k",))
    ck = L.run(k, (1,), (x[16:], 32, x, 0.25), {}, key=("k",))
    assert ck.direct == [(1, 1, 1, 77, "fn", "meta", None, None, None, x.data_ptr() + 64, 32, x.data_ptr(), 0.25, 16)]
    assert all(type(a) is not torch.Tensor for a in ck.direct[0])


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


def test_arguments_of_unknown_kind_take_tritons_path(cuda_like):
    k, x = Kernel(), torch.zeros(4)
    for _ in range(2):
        L.run(k, (1,), (x, np.int64(16)), {}, key=("k",))
    assert len(k.via_triton) == 2


def test_defaults_fill_the_parameters_not_passed(cuda_like):
    k, x = Kernel(), torch.zeros(4)
    ck = L.run(k, (1,), (x, 16), {}, key=("k",))
    L.run(k, (2,), (x, 32), {}, key=("k",))
    assert ck.direct == [(2, 1, 1, 77, "fn", "meta", None, None, None, x.data_ptr(), 32, 16)]


def test_keys_are_at_least_as_fine_as_tritons_specialisation():
    """For pairs of arguments of every kind the launches pass (tensors aligned or not, ints 1, of 16
    and others, wide ints, floats, bools, None, Gluon tensor descriptors of several blocks and
    dtypes): equal keys imply equal Triton specialisations."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon import language as gl

    from gdn.ops.delta.triton.fused_bwd import _tiles

    base = torch.empty(4096, dtype=torch.bfloat16)
    half = torch.empty(4096, dtype=torch.float16)
    descs = [_tiles(torch.empty(256, 128, dtype=dt), 256, blk, gdt) for dt, gdt in ((torch.bfloat16, gl.bfloat16),
                                                                                  (torch.float16, gl.float16))
             for blk in ((64, 128), (64, 64), (128, 128))]
    values = [base, base[1:], base[8:], half, torch.empty(8, dtype=torch.int32), 1, 2, 16, 17, 48, -16, 2 ** 31,
              2 ** 40 + 3, 2 ** 63, 0.5, 1.0, True, False, None] + descs
    for a in values:
        for b in values:
            if type(a) is not type(b) and not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                continue
            same_key = L._arg_key(a, False) == L._arg_key(b, False)
            sa, sb = (native_specialize_impl(BaseBackend, x, False, True, True) for x in (a, b))
            assert not same_key or sa == sb, (a, b, sa, sb)
    assert L._arg_key(descs[0], False) != L._arg_key(descs[1], False)


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
        assert ck.run.c_calls == [] and ck.run.py_calls == [(2, 5, 1, 77, "fn", "meta", None, None, None, x.data_ptr(), 48, 16)]
    else:
        assert ck.run.py_calls == []
        assert ck.run.c_calls == [(2, 5, 1, 77, "fn", False, True, None, None, "meta", None, None, None, x.data_ptr(), 48,
                                    16)]


def test_descriptor_kernels_launch_with_tensor_maps_encoded_once_per_address(cuda_like, monkeypatch):
    """A kernel with tensor descriptors (its launcher wraps the C function with triton 3.6's
    wrap_handle_tensordesc): launched through the C function itself with exactly the arguments
    the wrapper would pass it, each descriptor's tensor map encoded once per address and shape."""
    drv = pytest.importorskip("triton.backends.nvidia.driver")
    from triton.experimental.gluon import language as gl

    from gdn.ops.delta.triton.fused_bwd import _tiles

    encoded = []

    def encode(d, meta):
        encoded.append((d.base.data_ptr(), meta["block_size"]))
        return [("map", d.base.data_ptr(), tuple(meta["block_size"])), *d.shape, *d.strides]

    monkeypatch.setattr(drv, "make_tensordesc_arg", encode)
    monkeypatch.setattr(L, "_DIRECT_LAYOUT", True)
    monkeypatch.setattr(L, "_MAPS", {})
    c_calls = []
    metas = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[64, 128], fp4_padded=False),
             dict(swizzle=3, elem_size=2, elem_type=10, block_size=[64, 64], fp4_padded=False)]
    sig = {"a": "*bf16", "d": "tensordesc<bf16[64, 128]>", "n": "i32", "e": "tensordesc<bf16[64, 64]>", "BV": "constexpr"}
    wrapped = drv.wrap_handle_tensordesc(lambda *a: c_calls.append(a), sig, metas)
    launcher = Launcher()
    launcher.launch = wrapped
    ck = Compiled()
    ck.run = launcher
    go = L._launcher(ck)
    x, y = torch.zeros(256, 128, dtype=torch.bfloat16), torch.zeros(256, 128, dtype=torch.bfloat16)
    d1, e1 = _tiles(x, 256, (64, 128), gl.bfloat16), _tiles(x, 256, (64, 64), gl.bfloat16)
    base = (2, 1, 1, 77, "fn", False, True, None, None, "meta", None, None, None)
    go(2, 1, 1, 77, x, d1, 5, e1, 64)
    wrapped(*base, x, d1, 5, e1, 64)  # the wrapper's own expansion, for comparison
    assert c_calls[0] == c_calls[1] and len(c_calls[0]) == 13 + 1 + 5 + 1 + 5 + 1, c_calls[0]
    encoded.clear()
    go(2, 1, 1, 77, x, _tiles(x, 256, (64, 128), gl.bfloat16), 5, e1, 64)  # a new descriptor of the same tensor
    assert encoded == []
    go(2, 1, 1, 77, x, _tiles(y, 256, (64, 128), gl.bfloat16), 5, e1, 64)  # another address: encoded
    assert encoded == [(y.data_ptr(), [64, 128])]
    assert c_calls[-1][13 + 1] == ("map", y.data_ptr(), (64, 128))
    # a descriptor launched again keeps its encoding (the address cache not even asked), unless the
    # kernel's descriptor metadata differs
    encoded.clear()
    L._MAPS.clear()
    go(2, 1, 1, 77, x, d1, 5, e1, 64)
    assert encoded == [] and c_calls[-1] == c_calls[0]
    other = drv.wrap_handle_tensordesc(lambda *a: c_calls.append(a), {"a": "*bf16", "d": "tensordesc<bf16[64, 128]>",
                                                                      "n": "i32", "e": "tensordesc<bf16[64, 64]>",
                                                                      "BV": "constexpr"},
                                       [dict(metas[0], swizzle=2), metas[1]])
    launcher2 = Launcher()
    launcher2.launch = other
    ck2 = Compiled()
    ck2.run = launcher2
    L._launcher(ck2)(2, 1, 1, 77, x, d1, 5, e1, 64)
    assert encoded == [(x.data_ptr(), [64, 128])]


def test_launch_keys_equal_exactly_when_every_argument_key_does():
    """launch._arg_keys (the values' types, then each kind keyed in one pass) of two argument lists
    are equal exactly when :func:`launch._arg_key` of every argument is, for every kind a launch
    passes: plain tensors aligned or not, a Parameter (a tensor subclass), ints, floats, None,
    bools, Gluon tensor descriptors with and without their key, and compile-time constants; equal
    layouts built apart share their key, different ones do not."""
    from triton.experimental.gluon import language as gl

    from gdn.ops.delta.triton.fused_bwd import _smem, _tiles

    base = torch.empty(4096, dtype=torch.bfloat16)
    d = _tiles(torch.empty(256, 128, dtype=torch.bfloat16), 256, (64, 128), gl.bfloat16)
    e = _tiles(torch.empty(256, 128, dtype=torch.bfloat16), 256, (64, 64), gl.bfloat16)
    plain = copy.copy(d)
    del plain.launch_key
    flags = [False] * 6 + [True] * 2
    first = [base, torch.empty(8, dtype=torch.float32), 16, 0.5, None, d, 64, gl.bfloat16]
    # the alternatives of each position: values of the same kind and of other kinds
    pool = {0: [base, base[1:], base[8:], torch.nn.Parameter(torch.zeros(3)), torch.empty(4, dtype=torch.float16), 3],
            1: [torch.empty(8, dtype=torch.float32), torch.empty(8, dtype=torch.int32), None],
            2: [16, 32, 17, 1, 2 ** 40, 0.25, True],
            3: [0.5, 1.5, 7, None, False],
            4: [None, 0.5, base],
            5: [d, plain, e, base],
            6: [64, 32],
            7: [gl.bfloat16, gl.float16]}
    lists = [first] + [first[:i] + [v] + first[i + 1:] for i, vs in pool.items() for v in vs]
    lists.append([base[1:], base[8:], 3, 0.5, None, d, 64, gl.bfloat16])  # two tensors, one misaligned
    lists.append([base[8:], base[1:], 3, 0.5, None, d, 64, gl.bfloat16])
    for a in lists:
        for b in lists:
            same = all(L._arg_key(x, c) == L._arg_key(y, c) for x, y, c in zip(a, b, flags))
            assert (L._arg_keys(a, flags) == L._arg_keys(b, flags)) == same, (a, b)
    assert L._arg_key(plain, False) == L._arg_key(d, False) == d.launch_key
    same = L._interned(_smem([64, 128], gl.bfloat16))
    assert same == L._interned(_smem([64, 128], gl.bfloat16)) != L._interned(_smem([64, 32], gl.bfloat16))
    with pytest.raises(TypeError):
        L._arg_keys([np.int64(3)], [False])


def test_direct_keys_the_keyword_arguments(cuda_like):
    """launch.direct(kernel, grid, *args, **kw) is ``kernel[grid](*args, **kw)`` through run: the
    launcher is reused for the same keywords and specialisation, a new keyword value compiles."""
    k, x = Kernel(), torch.zeros(4)
    ck = L.direct(k, (2,), x, 32, BV=64, num_warps=4)
    assert L.direct(k, (3,), x, 48, BV=64, num_warps=4) is ck and len(k.via_triton) == 1
    assert ck.direct == [(3, 1, 1, 77, "fn", "meta", None, None, None, x.data_ptr(), 48, 64)]
    L.direct(k, (3,), x, 48, BV=32, num_warps=4)
    L.direct(k, (3,), x, 48, BV=64, num_warps=8)
    assert len(k.via_triton) == 3


def test_settings_key_tensor_keywords_by_dtype():
    """launch.settings: keywords as (name, value) pairs, a tensor keyword (a Parameter too) as its
    dtype, so that a launch's caches neither miss on each call's new tensor nor keep it alive."""
    meta = dict(K=128, DT="bf16", USE_G=True, scale=0.5, none=None)
    assert L.settings(meta) == tuple(meta.items())
    for beta in (torch.zeros(3), torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))):
        key = L.settings(dict(meta, beta=beta))
        assert key == tuple(meta.items()) + (("beta", ("tensor", beta.dtype)),)
    assert L.settings(meta) == tuple(meta.items())  # the plain types learnt stay plain
