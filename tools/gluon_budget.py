"""Registers, spills and shared memory, for sm_90, of the value loop of a per-chunk fused backward
written in Gluon (Triton's explicit-layout language) and of the fused backward kernel itself
(gdn.ops.delta.triton.fused_bwd), without a GPU.

The loop is what decides whether the fused backward fits (docs/TRITON.md, "The next structure"):
per value tile of one chunk and value head it accumulates dO δᵀ and dδ δᵀ ([64, 64]) and dO Sᵀ,
δ dSᵀ and dδ Sᵀ ([64, K]) by warpgroup MMAs whose operands sit in shared memory and whose fp32
accumulators are laid out over the warps explicitly. Its tiles come in by plain loads (a tensor-copy
ring would keep them out of registers altogether); the five accumulators are stored at the end so
that nothing is optimised away. Outputs are never checked: nothing runs.

    python tools/gluon_budget.py                 # K = V = 128, 8 and 4 warps, value tiles of 64 and 32
    python tools/gluon_budget.py --K 256 --V 256
    TRITON_CACHE_DIR=$(mktemp -d) python tools/gluon_budget.py --items 1,2,3   # items a program
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gdn.ops.delta.triton.fused_bwd import acc_layout  # noqa: E402  (the kernel's accumulator layout)
from tools.ncu_stalls import opcode  # noqa: E402  (the one opcode reader for SASS text)

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@gluon.jit
def value_loop(d_ptr, do_ptr, dd_ptr, h_ptr, dh_ptr, out, BT: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
               BV: gl.constexpr, num_warps: gl.constexpr):
    """One program: a chunk's δ, dO, dδ [BT, V] and its states S, dS [K, V] (bf16, row-major) in,
    the five accumulators out (fp32)."""
    pid = gl.program_id(0)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BV], gl.bfloat16)
    state: gl.constexpr = gl.NVMMASharedLayout.get_default_for([K, BV], gl.bfloat16)
    s_d = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], rows)
    s_do = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], rows)
    s_dd = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], rows)
    s_h = gl.allocate_shared_memory(gl.bfloat16, [K, BV], state)
    s_dh = gl.allocate_shared_memory(gl.bfloat16, [K, BV], state)
    a_t: gl.constexpr = acc_layout(BT, num_warps)
    a_k: gl.constexpr = acc_layout(K, num_warps)
    dod = gl.zeros([BT, BT], gl.float32, a_t)
    ddd = gl.zeros([BT, BT], gl.float32, a_t)
    dqs = gl.zeros([BT, K], gl.float32, a_k)
    dks = gl.zeros([BT, K], gl.float32, a_k)
    dw = gl.zeros([BT, K], gl.float32, a_k)
    r = gl.arange(0, BT, layout=gl.SliceLayout(1, ld))
    rk = gl.arange(0, K, layout=gl.SliceLayout(1, ld))
    c = gl.arange(0, BV, layout=gl.SliceLayout(0, ld))
    base = pid.to(gl.int64) * BT * V
    base_s = pid.to(gl.int64) * K * V
    for i_v in range(0, V // BV):
        p_t = base + r[:, None] * V + (i_v * BV + c)[None, :]
        p_s = base_s + rk[:, None] * V + (i_v * BV + c)[None, :]
        s_d.store(gl.load(d_ptr + p_t))
        s_do.store(gl.load(do_ptr + p_t))
        s_dd.store(gl.load(dd_ptr + p_t))
        s_h.store(gl.load(h_ptr + p_s))
        s_dh.store(gl.load(dh_ptr + p_s))
        fence_async_shared()
        dod = warpgroup_mma(s_do, s_d.permute((1, 0)), dod, is_async=True)
        ddd = warpgroup_mma(s_dd, s_d.permute((1, 0)), ddd, is_async=True)
        dqs = warpgroup_mma(s_do, s_h.permute((1, 0)), dqs, is_async=True)
        dks = warpgroup_mma(s_d, s_dh.permute((1, 0)), dks, is_async=True)
        dw = warpgroup_mma(s_dd, s_h.permute((1, 0)), dw, is_async=True)
        dod, ddd, dqs, dks, dw = warpgroup_mma_wait(num_outstanding=0, deps=(dod, ddd, dqs, dks, dw))
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, a_t))
    c_t = gl.arange(0, BT, layout=gl.SliceLayout(0, a_t))
    o_k = gl.arange(0, BT, layout=gl.SliceLayout(1, a_k))
    c_k = gl.arange(0, K, layout=gl.SliceLayout(0, a_k))
    ob = pid.to(gl.int64) * (2 * BT * BT + 3 * BT * K)
    gl.store(out + ob + o_t[:, None] * BT + c_t[None, :], dod)
    gl.store(out + ob + BT * BT + o_t[:, None] * BT + c_t[None, :], ddd)
    gl.store(out + ob + 2 * BT * BT + o_k[:, None] * K + c_k[None, :], dqs)
    gl.store(out + ob + 2 * BT * BT + BT * K + o_k[:, None] * K + c_k[None, :], dks)
    gl.store(out + ob + 2 * BT * BT + 2 * BT * K + o_k[:, None] * K + c_k[None, :], dw)


def resources(K: int, V: int, BV: int, num_warps: int) -> dict:
    """{"regs", "spill" (stack bytes), "shared" (bytes)} of :func:`value_loop` compiled for sm_90."""
    sig = {n: "*bf16" for n in ("d_ptr", "do_ptr", "dd_ptr", "h_ptr", "dh_ptr")}
    sig["out"] = "*fp32"
    sig.update({n: "constexpr" for n in ("BT", "K", "V", "BV", "num_warps")})
    consts = {(6,): 64, (7,): K, (8,): V, (9,): BV, (10,): num_warps}
    return _compiled(GluonASTSource(value_loop, sig, consts, {}), num_warps)


def kernel_resources(K: int, V: int, BV: int, num_warps: int, NS: int | None = None, PER: int | None = None) -> dict:
    """{"regs", "spill", "shared"} of the fused backward kernel itself
    (:func:`gdn.ops.delta.triton.fused_bwd.fused_bwd_kernel`, bf16) compiled for sm_90, with a ring
    of ``NS`` slots and ``PER`` items a program (defaults: the launch setting's), specialised as
    Triton's launcher specialises a launch at Qwen's layouts: every pointer 16-byte aligned (torch's
    allocations are) and H, HV multiples of 16. The alignment changes the code ptxas gets (at
    K = V = 128 it is what spills three registers)."""
    from gdn.ops.delta.triton import fused_bwd as F  # noqa: PLC0415
    from gdn.ops.tuning import DELTA  # noqa: PLC0415

    NS = DELTA["fused_bwd"]["NS"] if NS is None else NS
    PER = DELTA["fused_bwd"]["items"] if PER is None else PER
    names = F.fused_bwd_kernel.arg_names
    sig = {n: "*bf16" for n in names}
    sig.update({n: "*fp32" for n in ("G", "beta", "DB", "DG")})

    def desc(rows, cols=BV):
        return f"tensordesc<bf16[{rows}, {cols}],{F._tile((rows, cols), gl.bfloat16, torch.bfloat16)[0]!r}>"

    sig.update({n: desc(64) for n in ("d_t", "do_t", "dd_t", "v_t", "dv_t")})
    sig.update(h_t=desc(K), dh_t=desc(K), ai_t=desc(64, 64))
    sig.update({n: desc(64, K) for n in ("q_t", "k_t", "dq_t", "dk_t")})
    sig.update(cu="*i32", chunk_idx="*i32", rows="*i32", scale="fp32", H="i32", HV="i32", NW="i32",
               K="constexpr", V="constexpr", BV="constexpr", NS="constexpr", DT="constexpr", QK_TMA="constexpr",
               DV_TMA="constexpr", PER="constexpr")
    at = {n: i for i, n in enumerate(names)}
    consts = {(at["K"],): K, (at["V"],): V, (at["BV"],): BV, (at["NS"],): NS, (at["DT"],): gl.bfloat16,
              (at["QK_TMA"],): True, (at["DV_TMA"],): True, (at["PER"],): PER}
    return _compiled(GluonASTSource(F.fused_bwd_kernel, sig, consts, _aligned(sig, at)), num_warps)


def forward_resources(K: int, V: int, NS: int | None = None, regs=None, maxnreg: int | None = None,
                      warm: bool = False, states: bool = False, VT: int | None = None) -> dict:
    """{"regs", "spill", "shared"} of the warp-specialised forward pass
    (:func:`gdn.ops.delta.triton.fused_fwd.fused_fwd_kernel`, bf16, initial and final state)
    compiled for sm_90 at the launch setting (or the given ring slots, partition registers and
    maxnreg; ``warm``: the warm-started segments' form; ``states``: the backward's state pass, no
    output warpgroup, h and δ stored), each program on a value tile of ``fused_fwd.value_tile(V)``
    columns as the launch takes it (or ``VT``)."""
    from gdn.ops.delta.triton import fused_bwd as B  # noqa: PLC0415
    from gdn.ops.delta.triton import fused_fwd as F  # noqa: PLC0415
    from gdn.ops.tuning import DELTA  # noqa: PLC0415

    name = "fused_states" if states else "fused_fwd"
    c = DELTA[name]
    NS = c["NS"] if NS is None else NS
    regs = tuple(c["regs"] if regs is None else regs) + (0,)
    names = F.fused_fwd_kernel.arg_names
    VT = F.value_tile(V, name) if VT is None else VT

    def desc(cols):
        return f"tensordesc<bf16[64, {cols}],{B._tile((64, cols), gl.bfloat16, torch.bfloat16)[0]!r}>"

    hdesc = f"tensordesc<bf16[{K}, {VT}],{B._tile((K, VT), gl.bfloat16, torch.bfloat16)[0]!r}>"
    sig = dict(q_t=desc(K), k_t=desc(K), v_t=desc(VT), a_t=desc(64), h_t=hdesc, G="*fp32",
               beta="*fp32", h0="*fp32", o="*bf16", VN="*bf16", ht="*fp32", cu="*i32", off="*i32", plan="*i32",
               seg_seq="*i32", seq_cu="*i32", scale="fp32", H="i32", HV="i32")
    const = dict(K=K, V=V, VT=VT, NS=NS, DT=gl.bfloat16, USE_INIT=True, STORE_FINAL=True, WARM=warm,
                 OUT=not states, STORE_H=states, R_COPY=regs[0], R_DELTA=regs[1], R_OUT=regs[2])
    sig.update({n: "constexpr" for n in const})
    at = {n: i for i, n in enumerate(names)}
    consts = {(at[n],): v for n, v in const.items()}
    sig = {n: sig[n] for n in names}
    return _compiled(GluonASTSource(F.fused_fwd_kernel, sig, consts, _aligned(sig, at)), c["num_warps"],
                     maxnreg=c["maxnreg"] if maxnreg is None else maxnreg)


def reverse_resources(K: int, V: int, NS: int | None = None, regs=None, maxnreg: int | None = None,
                      warm: bool = False, VT: int | None = None, carry: bool = False) -> dict:
    """{"regs", "spill", "shared"} of the warp-specialised reverse pass
    (:func:`gdn.ops.delta.triton.fused_rev.fused_rev_kernel`, bf16, final- and initial-state
    gradients) compiled for sm_90 at the launch setting (or the given ring slots, partition registers
    and maxnreg; ``warm``: the warm-started segments' form, ``carry``: its sliced form's first
    slice, dS entering every program stored), each program on a value tile of
    ``fused_fwd.value_tile(V, "fused_rev")`` columns as the launch takes it (or ``VT``)."""
    from gdn.ops.delta.triton import fused_bwd as B  # noqa: PLC0415
    from gdn.ops.delta.triton import fused_fwd as FF  # noqa: PLC0415
    from gdn.ops.delta.triton import fused_rev as F  # noqa: PLC0415
    from gdn.ops.tuning import DELTA  # noqa: PLC0415

    c = DELTA["fused_rev"]
    NS = c["NS"] if NS is None else NS
    regs = tuple(c["regs"] if regs is None else regs)
    VT = FF.value_tile(V, "fused_rev") if VT is None else VT

    def desc(rows, cols):
        return f"tensordesc<bf16[{rows}, {cols}],{B._tile((rows, cols), gl.bfloat16, torch.bfloat16)[0]!r}>"

    sig = dict(q_t=desc(64, K), k_t=desc(64, K), do_t=desc(64, VT), a_t=desc(64, 64), dh_t=desc(K, VT), G="*fp32",
               beta="*fp32", dht="*fp32", dh0="*fp32", DD="*bf16", cu="*i32", ends="*i32", off="*i32", plan="*i32",
               seg_seq="*i32", seq_cu="*i32", scale="fp32", H="i32", HV="i32")
    const = dict(K=K, V=V, VT=VT, NS=NS, DT=gl.bfloat16, USE_DHT=True, USE_INIT=True, WARM=warm, CARRY=carry,
                 R_COPY=regs[0], R_DELTA=regs[1], R_LOCAL=regs[2])
    sig.update({n: "constexpr" for n in const})
    names = F.fused_rev_kernel.arg_names
    at = {n: i for i, n in enumerate(names)}
    consts = {(at[n],): v for n, v in const.items()}
    sig = {n: sig[n] for n in names}
    return _compiled(GluonASTSource(F.fused_rev_kernel, sig, consts, _aligned(sig, at)), c["num_warps"],
                     maxnreg=c["maxnreg"] if maxnreg is None else maxnreg)


def _aligned(sig: dict, at: dict) -> dict:
    """The attributes Triton's launcher gives a launch at Qwen's layouts: every pointer argument
    16-byte aligned (torch's allocations are) and H, HV multiples of 16 (``tt.divisibility``)."""
    names = [n for n, t in sig.items() if t.startswith("*")] + [n for n in ("H", "HV") if n in sig]
    return {(at[n],): [["tt.divisibility", 16]] for n in names}


def rbwd_resources(regs=None, maxnreg: int | None = None, warm: bool = True, cubin: bool = False,
                   qk_b: bool | None = None, dk_b: bool | None = None) -> dict:
    """{"regs", "spill", "shared"} of the merged backward kernel
    (:func:`gdn.ops.delta.triton.fused_rbwd.fused_rbwd_kernel`, bf16, K = V = 128, with dht and dh0,
    ``warm``: the warm-started segments' form) compiled for sm_90 with the partitions' registers
    ``regs`` = (copies, A, B), ``maxnreg``, ``qk_b`` (B forms dγ's pair terms) and ``dk_b`` (B
    forms dK's terms through M and dW; defaults: the launch setting's). "spill" is the
    program's stack frame, the largest any partition needs."""
    from gdn.ops.delta.triton import fused_rbwd as R  # noqa: PLC0415
    from gdn.ops.tuning import DELTA  # noqa: PLC0415

    c = DELTA["fused_rbwd"]
    regs = tuple(c["regs"]) if regs is None else tuple(regs)
    maxnreg = c["maxnreg"] if maxnreg is None else maxnreg
    K = V = 128
    desc = desc_type
    sig = dict(q_t=desc(64, K), k_t=desc(64, K), do_t=desc(64, V), a_t=desc(64, 64), d_t=desc(64, V),
               h_t=desc(K, V), v_t=desc(64, V), G="*fp32", beta="*fp32", dht="*fp32", dh0="*fp32", DQ="*bf16",
               DK="*bf16", DV="*bf16", DB="*fp32", DG="*fp32", cu="*i32", ends="*i32", off="*i32", plan="*i32",
               seg_seq="*i32", seq_cu="*i32", scale="fp32", H="i32", HV="i32")
    const = dict(K=K, V=V, DT=gl.bfloat16, USE_DHT=True, USE_INIT=True, WARM=warm, R_COPY=regs[0], R_A=regs[1],
                 R_B=regs[2], QK_B=bool(c["qk_b"]) if qk_b is None else qk_b,
                 DK_B=bool(c["dk_b"]) if dk_b is None else dk_b)
    sig.update({n: "constexpr" for n in const})
    names = R.fused_rbwd_kernel.arg_names
    at = {n: i for i, n in enumerate(names)}
    sig = {n: sig[n] for n in names}
    consts = {(at[n],): v for n, v in const.items()}
    return _compiled(GluonASTSource(R.fused_rbwd_kernel, sig, consts, _aligned(sig, at)), 4, cubin=cubin,
                     maxnreg=maxnreg)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump's ``flag`` output for a compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(BIN, "cuobjdump"), flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def sass(cubin: bytes) -> str:
    """The SASS of a compiled kernel's cubin (cuobjdump -sass)."""
    return _cuobjdump(cubin, "-sass")


def _instructions(sass_text: str):
    """(source, opcode) of each instruction line of cuobjdump's SASS text, in order."""
    for line in sass_text.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            yield m.group(1), opcode(m.group(1))


def partition_counts(sass_text: str) -> list:
    """Per partition of a warp-specialised kernel's SASS (the code from one register reallocation,
    ``USETMAXREG``, to the next; the first entry is the code before any): its instructions and how
    many of them are HGMMA steps, spill stores (STL) and spill loads (LDL)."""
    out = [dict(n=0, HGMMA=0, STL=0, LDL=0)]
    for _, op in _instructions(sass_text):
        if op == "USETMAXREG":
            out.append(dict(n=0, HGMMA=0, STL=0, LDL=0))
        cur = out[-1]
        cur["n"] += 1
        if op in cur:
            cur[op] += 1
    return out


def _operands(source: str) -> list:
    """An instruction's operand words, its predicate and opcode left out (``@!P3 LDG.E R26, desc[UR60][R98.64]``
    → ``["R26", "desc[UR60][R98.64]"]``)."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return " ".join(words[1:]).replace(",", " ").split()


def load_chains(sass_text: str, near: int = 8) -> list:
    """Per partition (as :func:`partition_counts`), the longest run of global loads each of which is
    read within ``near`` instructions, before the next global load issues: loads consumed one L2
    round trip after another rather than in flight together (what ptxas makes of many independent
    loads where registers are short: one destination register, each load used as it lands)."""
    out, run, pending = [0], 0, None
    for src, op in _instructions(sass_text):
        if op == "USETMAXREG":
            out.append(0)
            run, pending = 0, None
        if pending is not None:
            reg, age = pending
            ops = _operands(src)
            if reg in ops[1:] or (op in ("STG", "STS", "STL") and reg in ops):
                run += 1
                out[-1] = max(out[-1], run)
                pending = None
            elif age >= near or op == "LDG":
                run, pending = 0, None
            else:
                pending = (reg, age + 1)
        if op == "LDG":
            ops = _operands(src)
            pending = (ops[0], 0) if ops else None
    return out


def desc_type(rows: int, cols: int) -> str:
    """The signature type of a bf16 tensor descriptor read in [rows, cols] blocks, with the shared
    layout the launches give it (fused_bwd._tile)."""
    from gdn.ops.delta.triton import fused_bwd as F  # noqa: PLC0415

    return f"tensordesc<bf16[{rows}, {cols}],{F._tile((rows, cols), gl.bfloat16, torch.bfloat16)[0]!r}>"


def _compiled(src, num_warps: int, cubin: bool = False, **extra) -> dict:
    """{"regs", "spill", "shared", "seconds"} of ``src`` compiled for sm_90 (and its "cubin" with
    ``cubin``)."""
    opts = make_backend(TARGET).parse_options({"num_warps": num_warps, **extra})
    t = time.perf_counter()
    ck = triton.compile(src, target=TARGET, options=opts.__dict__)
    seconds = time.perf_counter() - t  # (a cache hit where TRITON_CACHE_DIR holds it already)
    usage = _cuobjdump(ck.asm["cubin"], "--dump-resource-usage")
    field = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
    out = {"regs": field["REG"], "spill": field["STACK"] + field["LOCAL"], "shared": ck.metadata.shared,
           "seconds": seconds}
    if cubin:
        out["cubin"] = ck.asm["cubin"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--K", type=int, default=128, help="key width (a power of two, 64-256)")
    ap.add_argument("--V", type=int, default=128, help="value width (a power of two ≥ the tiles)")
    ap.add_argument("--warps", default="8,4", help="warps per program to try (multiples of 4)")
    ap.add_argument("--tiles", default="64,32", help="value tile widths to try")
    ap.add_argument("--items", default=None,
                    help="items a program of the fused backward kernel to compile (e.g. 1,2,3): its table "
                         "alone, at 8 warps and the first tile width, with each compile's seconds (give "
                         "TRITON_CACHE_DIR an empty folder for cold compiles)")
    ap.add_argument("--qk-b", action="store_true", help="with --rbwd: B forms dγ's pair terms")
    ap.add_argument("--dk-b", action="store_true", help="with --rbwd: B forms dK's terms through M and dW")
    ap.add_argument("--rbwd", default=None, metavar="COPY,A,B",
                    help="the merged backward kernel (fused_rbwd) at these partition registers ('' for the "
                         "launch setting's)")
    a = ap.parse_args(argv)
    if a.rbwd is not None:
        regs = tuple(int(x) for x in a.rbwd.split(",")) if a.rbwd else None
        r = rbwd_resources(regs, cubin=True, qk_b=a.qk_b or None, dk_b=a.dk_b or None)
        print(f"fused_rbwd, K = V = 128, bf16, sm_90, triton {triton.__version__}, registers (copies, A, B) "
              f"{regs or 'of the launch setting'}: {r['spill']} B of stack, {r['shared'] / 1024:.1f} KB shared")
        print("partitions with matrix products (at the launch setting the chain 16 HGMMA steps, A 100, B 44): "
              "HGMMA / spill stores / spill loads, instructions of SASS")
        text = sass(r["cubin"])
        for c, chain in zip(partition_counts(text), load_chains(text)):
            if c["HGMMA"]:
                print(f"  {c['HGMMA']:3d} HGMMA: {c['STL']} STL, {c['LDL']} LDL; global loads consumed as they land, "
                      f"longest run: {chain}")
        return 0
    if a.items:
        bv = int(a.tiles.split(",")[0])
        print(f"The fused backward kernel, K = {a.K}, V = {a.V}, value tiles of {bv}, 8 warps, bf16, sm_90, "
              f"triton {triton.__version__}")
        print("| items a program | registers | spill bytes | shared KB | compile s |")
        print("|---|---|---|---|---|")
        for per in (int(x) for x in a.items.split(",")):
            r = kernel_resources(a.K, a.V, bv, 8, PER=per)
            print(f"| {per} | {r['regs']} | {r['spill']} | {r['shared'] / 1024:.0f} | {r['seconds']:.2f} |", flush=True)
        return 0
    tables = (("Gluon value loop of the per-chunk fused backward", resources),
              ("The fused backward kernel (gdn.ops.delta.triton.fused_bwd)", kernel_resources))
    for title, measure in tables:
        print(f"{title}, K = {a.K}, V = {a.V}, bf16, sm_90, triton {triton.__version__}")
        print("| warps | value tile | registers | spill bytes | shared KB |")
        print("|---|---|---|---|---|")
        for w in (int(x) for x in a.warps.split(",")):
            for bv in (int(x) for x in a.tiles.split(",")):
                r = measure(a.K, a.V, bv, w)
                print(f"| {w} | {bv} | {r['regs']} | {r['spill']} | {r['shared'] / 1024:.0f} |")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
