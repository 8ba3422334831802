"""tools/vector_access.py: at the 340m layer's layouts the SwiGLU and RMSNorm kernels (the gated
norm reading its gate in place from the joined projection, writing the gate's gradient back there)
move their 16-bit data as 16-byte vectors, compiled for sm_90 on the CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]

RUN = """
import sys, json
sys.path.insert(0, {root!r})
from tools import vector_access as V
print(json.dumps([(n, dict(a)) for n, a in V.glue_launches("gdn", "340m", 64, "norm_|swiglu")]))
"""


def test_glue_kernels_move_16_bit_data_as_vectors_at_340m():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", RUN.format(root=str(ROOT))], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    launches = json.loads(p.stdout.strip().splitlines()[-1])
    names = {n for n, _ in launches}
    assert {"_swiglu_fwd_kernel", "_swiglu_bwd_kernel", "_norm_fwd_kernel", "_norm_bwd_kernel"} <= names, names
    for name, acc in launches:
        narrow = {op: n for op, n in acc.items() if op.endswith(".b16")}
        assert not narrow, (name, acc)
        assert any(op.startswith("ld.global.v4") for op in acc) and any(op.startswith("st.global.v4") for op in acc), (
            name, acc)


def test_accesses_counts_opcodes():
    from tools.vector_access import accesses

    ptx = "ld.global.b16 %rs1, [%rd1];\n\tld.global.v4.b32 {%r1}, [%rd2];\n\tst.global.b16 [%rd3], %rs1;\n"
    assert accesses(ptx) == {"ld.global.b16": 1, "ld.global.v4.b32": 1, "st.global.b16": 1}


LOOPS = """
import sys, json
sys.path.insert(0, {root!r})
from gdn.ops import tuning
from tools import vector_access as V
# (few programs, so that a norm's program walks several blocks at 64 tokens)
tuning.update({{"other.rmsnorm": {{"programs": 2}}}})
print(json.dumps([(n, V.requests_ahead(b, s), V.runs(b), V.runs(s))
                  for n, _, b, s in V.glue_loops("gdn", "340m", 64, "^_norm_bwd|^_conv_bwd")]))
"""


def test_glue_backward_loops_request_their_loads_before_their_stores():
    """tools/vector_access.py --loops at the 340m layer: the short convolution's and the norms'
    backward loops issue every global load of an iteration before its first store (the next
    iteration's rows requested first), compiled for sm_90 on the CPU (a load after a store would
    wait for it: one iteration's loads in flight)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", LOOPS.format(root=str(ROOT))], capture_output=True, text=True,
                       env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    loops = json.loads(p.stdout.strip().splitlines()[-1])
    assert {r[0] for r in loops} == {"_conv_bwd_kernel", "_norm_bwd_kernel"}, loops
    assert all(r[1] for r in loops), loops


def test_loop_accesses_reads_the_largest_loop():
    from tools.vector_access import loop_accesses, requests_ahead, runs

    code = ["LDG.E.128 R1", "LDG.E.128 R2", "STG.E.128 R3", "LDG.E R4", "@P0 BRA 0x0030", "STG.E.128 R5",
            "@P1 BRA 0x0010", "BRA 0x0090", "EXIT", "NOP"]
    sass = "\n".join(f"        /*{16 * i:04x}*/  {t} ;" for i, t in enumerate(code))
    before, body = loop_accesses(sass)
    assert (runs(before), runs(body)) == ("L1", "L1 S1 L1 S1")
    assert not requests_ahead(before, body)  # a load after a store
    assert requests_ahead(["L", "L"], ["L", "L", "S"]) and not requests_ahead(["L"], ["L", "L", "S"])
    assert loop_accesses("/*0000*/ LDG.E R1 ;\n/*0010*/ STG.E R2 ;") == ([], [])
