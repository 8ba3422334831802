"""How the chunk kernels launch: one mechanism that picks among the candidates of a kernel's
entry in :mod:`gdn.ops.tuning`, and the parallel first-call compile.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import os
from itertools import repeat
from operator import attrgetter, itemgetter, or_
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
import triton

from ..tuning import DELTA, INTERPRET, for_dtype

def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (4 off CUDA, e.g. under the interpreter); a device named with its
    index is looked up in a dict (the launch rules ask it about ten times a call)."""
    hit = _SMS.get(device)
    if hit is None:
        if device.type != "cuda":
            return 4
        hit = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        if device.index is not None:
            _SMS[device] = hit
    return hit


_SMS: dict = {}


def has_tma(x: torch.Tensor) -> bool:
    """Whether ``x``'s device copies tensor tiles with the tensor-memory accelerator (CUDA compute
    capability 9 or later), so that kernels may read or write it through tensor descriptors; under
    the interpreter (which runs descriptors too) always."""
    return INTERPRET or (x.is_cuda and major(x.device) >= 9)


def major(device: torch.device) -> int:
    """The compute capability's major number of CUDA ``device`` (looked up once per device: the
    query takes ≈ 5 µs of host, and the launch rules ask it several times a call)."""
    return _major(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_TENSOR = torch.Tensor
_STAGES: dict = {}
_RECORD: list | None = None  # launches collected instead of run, inside recording()
log = logging.getLogger(__name__)


def launch(kernel, grid, *args, name: str, config: dict | None = None, io=None, **meta):
    """``kernel[grid](*args, **meta)`` with the warps of ``config[name]`` (default: this module's
    tuning's ``DELTA`` table; for inputs of dtype ``io``, its overrides for them:
    gdn.ops.tuning.for_dtype) and one of its candidates ``stages``: software-pipelining depths, each
    an int or a pair (depth, form), a form being compile-time switches of the kernel (e.g. one that
    needs less shared memory for more arithmetic).

    Which candidate: with ``waves`` set in the kernel's config (the sequential passes, whose grids
    are about one wave of programs, each walking a whole sequence), :func:`by_waves` picks; else
    the first whose shared memory fits the card (remembered per kernel and compile-time arguments,
    so the fallback costs one failed load at most). Inside :func:`recording` nothing runs (a
    ``waves`` launch records each of its candidates)."""
    cfg = for_dtype((DELTA if config is None else config)[name], io)
    cands, ckey = _candidates(cfg["stages"])
    meta["num_warps"] = cfg["num_warps"]
    key = (id(kernel), settings(meta), ckey)  # by id: a JITFunction's own hash runs Python code
    waves = cfg.get("waves", False) and len(cands) > 1 and not INTERPRET
    if _RECORD is not None:
        for ns, f in (cands if waves else [_STAGES.get(key, (cands[0],))[0]]):
            _RECORD.append((kernel, grid, args, dict(meta, **f, num_stages=ns)))
        return None
    if waves:
        dev = _device_index()
        pk = (key, dev, math.prod(grid))
        hit = _PICKS.get(pk)
        if hit is None:
            hit = _PICKS[pk] = _chosen(by_waves(kernel, grid, args, meta, cands, key + (dev,)))
    else:
        hit = _STAGES.get(key)
    if hit is not None:
        (ns, f), fkey = hit
        return run(kernel, grid, args, dict(meta, **f, num_stages=ns), key + fkey)
    for i, (ns, f) in enumerate(cands):
        try:
            out = kernel[grid](*args, num_stages=ns, **dict(meta, **f))
        except triton.runtime.errors.OutOfResources:
            if i == len(cands) - 1:
                raise
            continue
        _STAGES[key] = _chosen((ns, f))
        return out


_PICKS: dict = {}  # (launch key, device, programs) -> by_waves' choice


def _chosen(cand) -> tuple:
    """A chosen candidate (depth, form) with the hashable form of it that extends the launch's key."""
    ns, f = cand
    return cand, (ns, tuple(f.items()))


def settings(meta: dict) -> tuple:
    """A launch's keyword arguments as the caches' keys hold them: a tensor passed by keyword (an
    argument like any positional one, e.g. β in the shared keywords of state_bwd's launches) by its
    dtype, so that the caches neither miss on every call's new tensor nor keep it alive. (Callers
    pass their keywords in a fixed order; their types are tested as a set against those known
    not to be tensors, without a Python step per keyword: a launch has twenty.)"""
    types = set(map(type, meta.values()))
    if types <= _PLAIN or _learn_plain(types):
        return tuple(meta.items())
    return tuple((k, ("tensor", v.dtype)) if isinstance(v, _TENSOR) else (k, v) for k, v in meta.items())


_PLAIN: set = set()  # keyword types seen that are not tensors


def _learn_plain(types: set) -> bool:
    """Add the types of ``types`` that are not tensors to :data:`_PLAIN`; whether all of them are."""
    for t in types - _PLAIN:
        if issubclass(t, _TENSOR):
            return False
        _PLAIN.add(t)
    return True


def direct(kernel, grid, *args, **kw):
    """``kernel[grid](*args, **kw)`` through :func:`run` (the launches outside :func:`launch`'s
    candidates: the layers' glue and the decode kernels, whose host time per launch a model's step
    pays dozens of times). Inside :func:`recording` it runs nothing and is collected, as
    :func:`launch`'s are."""
    if _RECORD is not None:
        _RECORD.append((kernel, grid, args, dict(kw)))
        return None
    return run(kernel, grid, args, kw, (id(kernel), settings(kw)))


_LAUNCHERS: dict = {}


def run(kernel, grid, args, kw, key):
    """``kernel[grid](*args, **kw)``; ``key`` names (kernel, its keyword arguments) for the cache.

    Triton's own path (``JITFunction.run``) costs 25-42 µs of host time per launch of these
    kernels on the H200's host (its binder formats each tensor descriptor's layout to specialise
    on it), its compiled kernel's launcher 8-12 (docs/BENCHMARKS.md): the first launch of each
    specialisation goes through Triton's path, which compiles and launches; later ones find the
    compiled kernel by :func:`_arg_key` of every parameter's value (at least as fine as Triton's
    own specialisation, so the kernel found is the one Triton would take) and call its launcher
    directly (:func:`_launcher`). Under the interpreter, while a launch hook is set (a profiler's),
    and for an argument of a kind :func:`_arg_key` does not know, always Triton's path.

    The launcher is handed each tensor's address, not the tensor: given a tensor, Triton's C
    launcher calls its ``data_ptr`` method and asks the driver whether the address is device
    memory (``cuPointerGetAttribute``), per tensor and launch; the key has read the addresses
    already, and gdn's kernels take tensors on the device of the op's inputs, checked on entry
    (gdn.ops.checks)."""
    if INTERPRET or _hooked() or not hasattr(kernel, "device_caches"):
        return kernel[grid](*args, **kw)
    dev = torch.cuda.current_device()
    try:
        vals = _values(kernel, args, kw)
        ak, at, ptrs = _keyed(vals, _params(kernel)[2])
        fk = (key, dev, ak)
        ck = _LAUNCHERS.get(fk)
    except TypeError:  # an argument this does not know how Triton specialises: Triton's path
        return kernel[grid](*args, **kw)
    if ck is None:
        ck = kernel[grid](*args, **kw)
        if getattr(ck, "function", None) is not None:  # compiled and loaded (not a pending compile)
            _LAUNCHERS[fk] = (ck, _launcher(ck))
        return ck
    ck, go = ck
    if ptrs:
        vals = list(vals)
        for i, p in zip(at, ptrs):
            vals[i] = p
    g = tuple(grid) + (1, 1)
    go(g[0], g[1], g[2], _stream(dev), *vals)
    return ck


_PARAMS: dict = {}
_EMPTY = inspect.Parameter.empty


def _params(kernel) -> tuple:
    """(names, defaults, constexpr flags) of ``kernel``'s parameters, in order (read once a kernel;
    looked up by identity: a JITFunction's own hash runs Python code, twice a launch here). The
    entry holds the kernel, so its id is not reused while the entry stands."""
    hit = _PARAMS.get(id(kernel))
    if hit is None or hit[0] is not kernel:
        ps = kernel.params
        hit = _PARAMS[id(kernel)] = (kernel, (tuple(p.name for p in ps), tuple(p.default for p in ps),
                                              tuple(bool(p.is_constexpr) for p in ps)))
    return hit[1]


def _values(kernel, args, kw) -> tuple:
    """Every parameter's value in order, as Triton's binder binds them (the positional ``args``, then
    each later parameter from ``kw`` or its default); TypeError where one has neither."""
    names, defaults, _ = _params(kernel)
    vals = list(args)
    for n, d in zip(names[len(args):], defaults[len(args):]):
        v = kw.get(n, d)
        if v is _EMPTY:
            raise TypeError(f"no value for {n}")
        vals.append(v)
    return tuple(vals)


def _arg_keys(vals, constexpr) -> tuple:
    """A key of the values ``vals`` (``constexpr``: each one's flag) equal for two lists exactly
    when :func:`_arg_key` of every value is: the values' types, then by kind in C-level passes
    (:func:`_key_plan`, made once per types): the tensors' dtypes and whether all are 16-byte
    aligned (each one's alignment where not), the descriptors' keys, the ints' keys and the
    compile-time constants. A launch passes 20-40 arguments, and a Python step per argument was
    most of the key's host time."""
    return _keyed(vals, constexpr)[0]


def _keyed(vals, constexpr) -> tuple:
    """(:func:`_arg_keys` of ``vals``, the tensors' positions among them, their addresses)."""
    types = tuple(map(type, vals))
    plan = _PLANS.get((id(constexpr), types))
    if plan is None or plan[0] is not constexpr:
        plan = _PLANS[(id(constexpr), types)] = (constexpr, _key_plan(types, constexpr))
    tensors, descs, ints, consts, at = plan[1]
    ts = tensors(vals)
    if ts:
        ptrs = tuple(map(_DATA_PTR, ts))
        if functools.reduce(or_, ptrs) & 15:  # some tensor not 16-byte aligned: each one's
            aligned = tuple(not p & 15 for p in ptrs)
        else:
            aligned = True
        dts = tuple(map(_DTYPE, ts))
    else:
        aligned = dts = ptrs = ()
    ds = descs(vals)
    dk = tuple(map(getattr, ds, repeat("launch_key"), repeat(None))) if ds else ()
    if None in dk:
        dk = tuple(_arg_key(d, False) for d in ds)
    return (types, dts, aligned, dk, tuple(map(_int_key, ints(vals))), consts(vals)), at, ptrs


_PLANS: dict = {}
_DTYPE = attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr


def _picker(idx: list):
    """A function returning the tuple of the values at positions ``idx`` (C-level for several)."""
    if not idx:
        return lambda vals: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda vals: (vals[i],)
    return itemgetter(*idx)


def _key_plan(types: tuple, constexpr) -> tuple:
    """(tensors, descriptors, ints, constants): pickers of each kind's positions in a launch's
    values of these ``types`` (floats, bools and None are keyed by their type alone), then the
    tensors' positions; TypeError for a value of a kind :func:`_arg_key` does not know."""
    kinds: dict = {"t": [], "d": [], "i": [], "c": []}
    for i, (t, c) in enumerate(zip(types, constexpr)):
        if c:
            kinds["c"].append(i)
        elif issubclass(t, torch.Tensor):
            kinds["t"].append(i)
        elif t is int:
            kinds["i"].append(i)
        elif t in _DESCRIPTORS:
            kinds["d"].append(i)
        elif not (t is float or t is bool or t is type(None)):
            raise TypeError(f"no launch key for {t.__name__}")
    return tuple(_picker(kinds[k]) for k in "tdic") + (tuple(kinds["t"]),)


_I32, _U63 = 2 ** 31, 2 ** 63


def _arg_key(v, constexpr: bool):
    """What of argument ``v`` the compiled kernel depends on, at least as finely as Triton's
    specialisation: a compile-time constant's value; a tensor's dtype and 16-byte alignment; an
    int's being 1, its divisibility by 16 and its width; a tensor descriptor's dtype, block shape,
    shared-memory layout and padding; a float's, bool's or None's kind. TypeError for another kind."""
    if constexpr:
        hash(v)
        return v
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    t = type(v)
    if t is int:
        return _int_key(v)
    if t is float or t is bool or v is None:
        return t
    if t in _DESCRIPTORS:  # (one made with its key known, e.g. fused_bwd._tiles', carries it)
        key = v.__dict__.get("launch_key")
        if key is not None:
            return key
        return descriptor_key(t, v.base.dtype, v.block_shape, getattr(v, "layout", None), getattr(v, "padding", None))
    raise TypeError(f"no launch key for {t.__name__}")


def _int_key(v: int) -> tuple:
    """What Triton specialises an int argument on: being 1, divisibility by 16, its width."""
    return v == 1, v % 16 == 0, -_I32 <= v < _I32, v >= _U63


def descriptor_key(kind, dtype, block, layout, padding) -> int:
    """A small int standing for a tensor descriptor in launch keys (its class, tensor dtype, block
    shape, shared-memory layout and padding: what Triton specialises a kernel on), equal for equal
    descriptors."""
    return _small_id((kind, dtype, tuple(block), _interned(layout), padding))


_INTERNED: dict = {}


def _interned(layout):
    """A small int standing for shared-memory ``layout`` in launch keys, equal for equal layouts:
    looked up by identity first (the kernels' layouts are made once per tile shape, and hashing a
    Gluon layout runs Python code each time); the entry holds the layout, so its id is not reused."""
    if layout is None:
        return None
    hit = _INTERNED.get(id(layout))
    if hit is None or hit[0] is not layout:
        hit = _INTERNED[id(layout)] = (layout, _small_id(layout))
    return hit[1]


_IDS: dict = {}


def _small_id(value) -> int:
    """A small int standing for hashable ``value`` in the launch caches' keys, the same for equal
    values (an int hashes at no cost where the value's own hash runs Python code or walks a tuple)."""
    return _IDS.setdefault(value, len(_IDS))


def _descriptor_types() -> tuple:
    """The tensor descriptor classes this triton has (Triton's and Gluon's)."""
    out = []
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: PLC0415
        out.append(TensorDescriptor)
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor  # noqa: PLC0415
        out.append(GluonDescriptor)
    except ImportError:
        pass
    return tuple(out)


_DESCRIPTORS = _descriptor_types()


#: The launcher layout :func:`_launcher` calls into: triton 3.6's CudaLauncher (its ``launch``, the C
#: function, takes the grid, stream, function, the cooperative-grid and PDL flags, the two scratch
#: buffers, then what the launcher's own call passes on)
_DIRECT_LAYOUT = tuple(triton.__version__.split(".")[:2]) == ("3", "6")


def _launcher(ck):
    """``go(gx, gy, gz, stream, *bound values)`` launching compiled kernel ``ck``: its launcher's C
    function straight for a kernel that needs no scratch memory (what the launcher's own call does
    for it, less its Python: ≈ 2 µs of host per launch on the development CPU), else the launcher's
    call. A kernel with tensor descriptors (:func:`_unwrap_descriptors`) has each descriptor
    argument replaced by its encoded tensor map and shape (:func:`_encoded`) on the way in."""
    r, fn, meta = ck.run, ck.function, ck.packed_metadata
    c_launch = getattr(r, "launch", None)
    if (_DIRECT_LAYOUT and c_launch is not None and not getattr(r, "global_scratch_size", 1)
            and not getattr(r, "profile_scratch_size", 1)):
        coop, pdl = r.launch_cooperative_grid, r.launch_pdl
        raw = _unwrap_descriptors(c_launch)
        if raw is not None:
            c_raw, descs = raw
            last_first = descs[::-1]

            def go(gx, gy, gz, stream, *a):
                args = list(a)
                for i, m, mkey in last_first:  # each descriptor replaced by its map and shape, from the end
                    args[i:i + 1] = _encoded(a[i], m, mkey)
                return c_raw(gx, gy, gz, stream, fn, coop, pdl, None, None, meta, None, None, None, *args)

            return go
        return lambda gx, gy, gz, stream, *a: c_launch(gx, gy, gz, stream, fn, coop, pdl, None, None, meta, None,
                                                       None, None, *a)
    return lambda gx, gy, gz, stream, *a: r(gx, gy, gz, stream, fn, meta, None, None, None, *a)


def _unwrap_descriptors(c_launch):
    """(the C launch function, ((argument index, its descriptor metadata, :func:`_small_id` of the
    metadata), ...) in argument order) of
    a triton 3.6 launcher that wraps its C function to encode tensor descriptors at every launch
    (the closure of ``wrap_handle_tensordesc``), None for any other launch function: a plain
    kernel's C function, or a wrapper of another shape (then it encodes them itself)."""
    code, cells = getattr(c_launch, "__code__", None), getattr(c_launch, "__closure__", None)
    if code is None or not cells:
        return None
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    if set(free) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
        return None
    metas = free["tensordesc_meta"]
    if not metas or any(m is None for m in metas):
        return None
    descs = tuple((i, m, _small_id(tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(m.items()))))
                  for i, m in zip(sorted(free["tensordesc_indices"]), metas))
    return free["launcher"], descs


_MAPS: dict = {}
#: encoded tensor maps kept (a training loop's tensors come back at the same addresses step after
#: step; the bound keeps a loop of ever new addresses from growing the cache)
_MAPS_MAX = 1024


def _encoded(d, meta: dict, mkey) -> list:
    """What the launcher passes for tensor descriptor ``d`` (its tensor map encoded with the compiled
    kernel's descriptor metadata ``meta``, then its shape and strides), encoded once per address,
    shape, strides, padding and metadata: the map holds nothing else, so one encoded for earlier
    tensors at the same address and shape is the same map. The result is also kept on ``d`` (by
    ``mkey``): the backward's slices launch each kernel several times with the same descriptors, and
    a descriptor's base, shape and strides do not change once it is made."""
    own = d.__dict__.get("_encoded")
    if own is not None and own[0] == mkey:
        return own[1]
    key = (d.base.data_ptr(), tuple(d.shape), tuple(d.strides), d.padding, mkey)
    hit = _MAPS.get(key)
    if hit is None:
        from triton.backends.nvidia.driver import make_tensordesc_arg  # noqa: PLC0415  (CUDA only)

        if len(_MAPS) >= _MAPS_MAX:
            _MAPS.clear()
        hit = _MAPS[key] = make_tensordesc_arg(d, meta)
    d._encoded = (mkey, hit)
    return hit


def _hooked() -> bool:
    """Whether a launch hook is set (Triton keeps them in chains, empty by default: its own path
    then still builds each launch's metadata and calls the empty chains)."""
    rt = triton.knobs.runtime
    return any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def _stream(dev: int) -> int:
    """The current CUDA stream of device ``dev`` (as Triton's launch path takes it)."""
    return torch._C._cuda_getCurrentRawStream(dev)


def candidates(stages) -> list:
    """``stages`` (ints, or (depth, form) pairs) as a list of (depth, form dict) pairs."""
    return [(s, {}) if isinstance(s, int) else (int(s[0]), dict(s[1])) for s in stages]


_CANDS: dict = {}


def _candidates(stages) -> tuple:
    """(:func:`candidates` of ``stages``, a hashable key of them), made once per ``stages`` object
    (the entry holds the object, so its id is not reused): a launch costs no more host time."""
    hit = _CANDS.get(id(stages))
    if hit is None or hit[0] is not stages:
        c = candidates(stages)
        hit = _CANDS[id(stages)] = (stages, c, str(c))
    return hit[1], hit[2]


_FITS: dict = {}


def by_waves(kernel, grid, args, meta, cands, key) -> tuple:
    """Of ``cands`` [(pipeline depth, form)] (in the config's order: deepest first), the one whose
    compiled kernel runs ``grid`` in the fewest waves on the CUDA device ``key[-1]``, the first
    among equals. Each candidate is compiled once (``warmup``); its shared memory and registers
    give the programs one multiprocessor holds (:func:`per_sm`).

    Why: a sequential pass's program walks a whole sequence, one chunk step after another, so a
    second wave doubles the pass's time, while a deeper pipeline (the next chunks' tiles loaded
    during this chunk's products) shortens each step but takes shared memory. Measured on the H200
    (docs/TRITON.md "Waves"): where a third stage added a wave the pass got slower, where it kept
    the waves it got faster, in nine of ten cases; state_bwd's QS form at (4, 8192) runs two
    stages in one wave where the plain form needs two waves (446 against 568 µs), and is slower
    wherever it does not save a wave (1 × 32768: 948 against 714)."""
    fits, dev = _FITS.get(key), key[-1]
    if fits is None:
        fits = []
        for ns, f in cands:
            try:
                ck = kernel.warmup(*args, grid=grid, num_stages=ns, **dict(meta, **f))
                ck._init_handles()
            except triton.runtime.errors.OutOfResources:
                continue
            fits.append(((ns, f), per_sm(ck.metadata.shared, ck.n_regs, meta["num_warps"], _card(dev))))
        if not fits:
            raise triton.runtime.errors.OutOfResources(0, 0, f"shared memory of every candidate {cands}")
        _FITS[key] = fits
    return pick(fits, math.prod(grid), sm_count(torch.device("cuda", dev) if dev >= 0 else torch.device("cpu")))


def pick(fits, programs: int, sms: int):
    """From ``fits`` [(candidate, programs per multiprocessor)], the candidate with the fewest waves
    of ``programs`` on ``sms`` multiprocessors, the first among equals."""
    return min(enumerate(fits), key=lambda f: (-(-programs // (sms * max(f[1][1], 1))), f[0]))[1][0]


#: Per multiprocessor on Hopper (sm_90), used where the card does not say: shared memory (bytes),
#: 32-bit registers, resident threads
SM90 = dict(shared=228 * 1024, regs=65536, threads=2048)


def per_sm(shared: int, regs: int, warps: int, card: dict | None = None) -> int:
    """Programs one multiprocessor holds, by shared memory (1 KB of it reserved per program),
    registers (allocated per warp in units of 256) and threads. ``card``: :data:`SM90`'s keys
    (default: the current CUDA device's, else :data:`SM90`)."""
    c = card or _card(_device_index())
    warp_regs = -(-regs * 32 // 256) * 256
    return min(c["shared"] // (shared + 1024), c["regs"] // max(warp_regs * warps, 1), c["threads"] // (32 * warps))


def _device_index() -> int:
    """The current CUDA device's index, -1 where CUDA is not in use (not initialised in this process)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else -1


@functools.lru_cache(maxsize=None)
def _card(index: int) -> dict:
    """Per-multiprocessor limits of CUDA device ``index`` (:data:`SM90` for -1 or without CUDA)."""
    if index < 0 or not torch.cuda.is_available():
        return SM90
    p = torch.cuda.get_device_properties(index)
    return dict(shared=getattr(p, "shared_memory_per_multiprocessor", SM90["shared"]),
                regs=getattr(p, "regs_per_multiprocessor", SM90["regs"]),
                threads=getattr(p, "max_threads_per_multi_processor", SM90["threads"]))


@contextmanager
def recording():
    """Inside this context :func:`launch` and :func:`direct` run nothing and collect ``(kernel,
    grid, args, meta)`` instead (buffers are still allocated by the launchers, never written;
    ``meta`` holds ``num_stages`` where the launch chose one)."""
    global _RECORD
    saved, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = saved


_WARM: set = set()


def build_launcher(ck) -> None:
    """Build the launcher of compiled kernel ``ck`` into Triton's cache, as its first launch would."""
    from triton.runtime.driver import driver  # noqa: PLC0415  (the GPU driver: reached on CUDA only)

    driver.active.launcher_cls(ck.src, ck.metadata)


def precompile(key, dry_run) -> None:
    """Compile, in parallel threads, every kernel that ``dry_run()`` would launch, once per ``key``.

    A cold first call otherwise compiles the chunk kernels one after another (≈ 8 s for a
    forward + backward on the H200's host, each kernel 0.3–2 s of LLVM and ptxas); Triton's
    ``AsyncCompileMode`` takes ``warmup`` compiles on an executor. Nothing here is needed for
    correctness: on any failure the kernels compile at their launch as before.

    Each compiled kernel's launcher is built on the same threads: Triton makes one C extension per
    argument signature with the C compiler at a kernel's first launch (0.2-0.3 s each on the
    2-core development CPU, eight for a gated delta rule forward + backward, one after another);
    the first launch then finds it in Triton's cache."""
    if key in _WARM or INTERPRET:
        return
    _WARM.add(key)
    try:
        with recording() as launches:
            dry_run()
        workers = max(1, min(16, os.cpu_count() or 1, len(launches)))
        with ThreadPoolExecutor(workers) as ex:
            with triton.AsyncCompileMode(ex):
                pending = [kernel.warmup(*args, grid=grid, **meta) for kernel, grid, args, meta in launches]
            compiled = [k.result() if hasattr(k, "result") else k for k in pending]
            try:
                list(ex.map(build_launcher, {id(ck): ck for ck in compiled if hasattr(ck, "src")}.values()))
            except Exception as e:  # noqa: BLE001 - the kernels are compiled; a first launch builds its own
                log.debug("building the launchers ahead failed (%s: %s)", type(e).__name__, e)
    except Exception as e:  # noqa: BLE001 - an optimisation only; the launches compile themselves
        log.warning("parallel precompile of the chunk kernels failed (%s: %s); compiling at launch",
                    type(e).__name__, e)

