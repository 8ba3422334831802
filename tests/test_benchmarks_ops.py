"""benchmarks/ops_gpu.py's plumbing on the CPU: peer selection, shape indices, FlashQLA's gate, and
one pass of the comparison loop over tiny shapes with the GPU calls replaced (gdn's PyTorch chunk
form standing in for every peer), its markdown table and its JSON file."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import types
from pathlib import Path

import pytest
import torch

from gdn import ops

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "ops_gpu.py"


@pytest.fixture
def bench(monkeypatch):
    """The module, loaded with FLA's routing variables restored afterwards."""
    for name in ("FLA_FLASH_QLA", "FLA_TILELANG"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    spec = importlib.util.spec_from_file_location("ops_gpu_under_test", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert os.environ["FLA_FLASH_QLA"] == "0"  # set before anything could import FLA
    return mod


def test_parse_peers_and_indices(bench):
    assert bench.parse_peers("qla, gdn,FLA") == ["gdn", "fla", "qla"]
    assert bench.parse_peers(",".join(bench.PEERS)) == bench.PEERS
    for bad in ("gdn,flashqla", "", " , "):
        with pytest.raises(ValueError):
            bench.parse_peers(bad)
    assert bench.parse_indices("1,2,6,1", 7) == [1, 2, 6]
    with pytest.raises(ValueError):
        bench.parse_indices("7", 7)
    assert sorted(bench.DEFAULT_ORDER) == list(range(len(bench.SHAPES)))


def test_qla_gate(bench):
    inf = float("inf")
    assert bench.qla_skip(128, 256, 5, None, 0, inf, inf)[0] == "n/a"
    assert bench.qla_skip(128, 128, 2, [1], 0, inf, inf)[0] == "skip"
    assert "max-compile-s" in bench.qla_skip(128, 128, 1, [1], 240.5, 240, inf)[1]
    assert bench.qla_skip(128, 128, 1, None, 0, 240, 10)[0] == "skip"
    assert bench.qla_skip(128, 128, 1, None, 100, 240, 500) is None
    assert [i for i, s in enumerate(bench.SHAPES) if bench.qla_supported(bench.D, s[6] if len(s) > 6 else bench.D)] \
        == [0, 1, 2, 3, 4, 6]


def _on_cpu(bench, monkeypatch, qla):
    """Tiny shapes on the CPU; every peer is gdn's chunk form (FlashQLA through a stand-in module)."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "SHAPES", [
        ("tiny", 2, 40, 2, 2, None),
        ("tiny packed", 1, 40, 1, 2, [17, 23]),
        ("tiny V=32", 1, 24, 1, 1, None, 32),
    ])
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 2**29)
    monkeypatch.setattr(bench, "ceilings", lambda: (1e15, 1e12))
    bench.READY = []
    monkeypatch.setattr(bench, "triton_ready", lambda: bench.READY.append(len(bench.READY)))

    def do_bench(fn, warmup, rep, grad_to_none=None, return_mode="median"):
        for x in grad_to_none or ():
            x.grad = None
        fn()
        return 1.25
    monkeypatch.setattr(bench, "do_bench", do_bench)

    def chunk(xs, cu):
        return lambda: ops.gated_delta_rule(*xs, cu_seqlens=cu, backend="chunk")[0]
    monkeypatch.setattr(bench, "gdn_fn", chunk)
    monkeypatch.setattr(bench, "fla_fn", chunk)
    monkeypatch.setitem(bench._QLA, "mod", qla)


def test_rows_table_and_json(bench, monkeypatch, tmp_path):
    calls = []

    def qla_call(q, k, v, g, beta, cu_seqlens=None):
        calls.append(cu_seqlens)
        return ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens, backend="chunk")[0], None
    _on_cpu(bench, monkeypatch, types.SimpleNamespace(chunk_gated_delta_rule=qla_call))
    rs, rates, path = [], [math.nan, math.nan], tmp_path / "ops.json"
    bench.rows(rs, rates, order=[1, 0, 2], peers=bench.PEERS,
               on_row=lambda _: bench.write_json(str(path), {"peers": bench.PEERS}, rs))
    assert [(r["idx"], r["pass"]) for r in rs] == [(1, "fwd"), (1, "fwd+bwd"), (0, "fwd"), (0, "fwd+bwd"),
                                                   (2, "fwd"), (2, "fwd+bwd")]
    assert bench.READY == [0]  # Triton's one-time setup once, before the first row's first call
    for r in rs:
        for p in ("gdn", "fla", "sdpa"):
            assert r["peers"][p]["status"] == "ok", (r["shape"], p, r["peers"][p])
            assert r["peers"][p]["ms"] == 1.25 and r["peers"][p]["GiB"] == 0.5
        assert r["peers"]["qla"]["status"] == ("n/a" if r["idx"] == 2 else "ok")
        if r["pass"] == "fwd":
            assert r["peers"]["fla"]["o_rel_diff"] < 1e-6
    assert calls[0].dtype == torch.int32 and calls[0].tolist() == [0, 17, 40]  # packed: int32 offsets
    table = bench.markdown(rs, bench.PEERS)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rs) and all(line.count("|") == lines[0].count("|") for line in lines)
    assert "1.00×" in lines[2] and "n/a" in lines[-1]
    saved = json.loads(path.read_text())
    assert len(saved["rows"]) == len(rs) and saved["rows"][0]["peers"]["gdn"]["status"] == "ok"


def test_input_dtype(bench, monkeypatch):
    """--dtype sets q, k, v (and dO) and the bytes counted; g and beta stay fp32; FlashQLA's cells
    are "n/a" for fp32, which it does not take."""
    inf = float("inf")
    (q, k, v, g, beta), _ = bench.inputs(1, 8, 1, 1, None, 16, device="cpu")
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and g.dtype == beta.dtype == torch.float32
    bytes16 = bench.counts(1, 64, 1, 1)[2]
    assert bench.qla_skip(128, 128, 1, None, 0, inf, inf) is None and bench.dtype_name() == "bf16"
    monkeypatch.setattr(bench, "IO", bench.DTYPES["fp32"])
    (q, k, v, g, beta), _ = bench.inputs(1, 8, 1, 1, None, 16, device="cpu")
    assert q.dtype == k.dtype == v.dtype == torch.float32 and g.dtype == beta.dtype == torch.float32
    assert bench.counts(1, 64, 1, 1)[2] > bytes16
    assert bench.qla_skip(128, 128, 1, None, 0, inf, inf) == ("n/a", "16-bit inputs only")
    assert bench.dtype_name() == "fp32"


def test_a_failing_peer_and_the_compile_budget(bench, monkeypatch, capsys):
    def broken(*a, **k):
        raise RuntimeError("no kernel for this card\nsecond line")
    _on_cpu(bench, monkeypatch, types.SimpleNamespace(chunk_gated_delta_rule=broken))
    monkeypatch.setattr(bench, "fla_fn", lambda xs, cu: None)  # FLA not installed
    rs = []
    bench.rows(rs, [math.nan, math.nan], order=[0, 1], peers=["gdn", "fla", "qla"], max_compile_s=1e-9)
    for r in rs:
        assert r["peers"]["gdn"]["status"] == "ok"
        assert r["peers"]["fla"] == {"status": "err", "error": "ImportError: fla is not installed",
                                     "first_s": r["peers"]["fla"]["first_s"]}
    # the first FlashQLA cell runs (nothing spent yet) and fails; the budget (1 ns) then skips the rest
    assert rs[0]["peers"]["qla"]["error"] == "RuntimeError: no kernel for this card"
    assert [r["peers"]["qla"]["status"] for r in rs[1:]] == ["skip"] * 3
    out = capsys.readouterr().out
    assert "FlashQLA failed at tiny fwd: RuntimeError: no kernel for this card" in out
    table = bench.markdown(rs, ["gdn", "fla", "qla"])
    assert "| err | err |" in table and "max-compile-s" in table


def test_kda_implementation_names(monkeypatch):
    """benchmarks/kda_gpu.py --impls: names of its implementations, matched ignoring case."""
    monkeypatch.delenv("FLA_TILELANG", raising=False)
    spec = importlib.util.spec_from_file_location("kda_gpu_under_test", PATH.parent / "kda_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.parse_impls("fla chunk, gdn KDA") == ["gdn KDA", "FLA chunk"]
    with pytest.raises(ValueError):
        mod.parse_impls("gdn KDA,FLA")
    assert mod.clean({"a": [1.0, math.nan], "b": math.inf}) == {"a": [1.0, None], "b": None}


def test_kda_floors_count_what_each_kernel_moves(capsys):
    """benchmarks/floors.py --op kda: every KDA chunk kernel gets a byte floor, the matmul kernels
    a FLOP floor; both scale with the tokens, and the wider value head moves more bytes where V
    enters (state passes) and none more where it does not (kkt)."""
    spec = importlib.util.spec_from_file_location("floors_under_test", PATH.parent / "floors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    one, two = mod.floors_kda(1, 2048, 4, 128, 128), mod.floors_kda(2, 2048, 4, 128, 128)
    assert set(one) == {"gamma", "kkt", "wu", "state_fwd", "output", "dv_local", "state_bwd", "dqk", "wy_bwd",
                        "intra_bwd"}
    assert all(b > 0 and f >= 0 for b, f in one.values()) and one["gamma"][1] == 0
    assert all(two[k] == (2 * b, 2 * f) for k, (b, f) in one.items())
    wide = mod.floors_kda(1, 2048, 4, 128, 256)
    assert wide["kkt"] == one["kkt"] and wide["state_fwd"][0] > one["state_fwd"][0]
    mod.main(["--op", "kda", "--shape", "1,2048,4,128"])
    out = capsys.readouterr().out
    assert "| intra_bwd |" in out and "exponentials" in out


def test_fused_backward_floors_move_fewer_bytes(capsys):
    """benchmarks/floors.py --op fused: the per-chunk fused backward's design (only h and dh between
    its kernels) moves fewer bytes than the present backward's kernels at every shape, its fused
    kernel reads h and dh (two K × V states per chunk: its bytes grow with K · V), and the table
    prints every kernel."""
    spec = importlib.util.spec_from_file_location("floors_under_test", PATH.parent / "floors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bwd_now = ("fused_states", "fused_rev", "fused_bwd")
    bwd_pair = ("state_fwd (recompute)", "dv_local", "state_bwd", "dqk", "wy_bwd")
    bwd_fused = ("state_fwd (h only)", "state_bwd (dh only)", "fused per-chunk backward")
    for shape in ((8, 2048, 16, 128, 128), (1, 32768, 16, 128, 128), (4, 4096, 6, 128, 256)):
        now, pair, fused = mod.floors(*shape), mod.floors(*shape, pair=True), mod.floors_fused(*shape)
        assert set(now) == {"kkt_solve", "fused_fwd", *bwd_now} and "fused_bwd" not in pair
        # the design below the launches of compute capability 9, which are below the pair's (no dW,
        # fp32 dK partial or per-tile dγ between two kernels)
        bytes_of = [sum(t[k][0] for k in ks) for t, ks in ((fused, bwd_fused), (now, bwd_now), (pair, bwd_pair))]
        assert bytes_of[0] < bytes_of[1] < bytes_of[2], (shape, bytes_of)
    small, wide = mod.floors_fused(1, 2048, 4, 128, 128), mod.floors_fused(1, 2048, 4, 128, 256)
    key = "fused per-chunk backward"
    assert wide[key][0] - small[key][0] >= 2 * (2048 // 64) * 4 * 128 * 128 * 2  # h and dh doubled with V
    mod.main(["--op", "fused", "--shape", "1,2048,4,128"])
    out = capsys.readouterr().out
    assert all(f"| {k} |" in out for k in bwd_fused + ("kkt_solve", "state_out"))


def test_kda_table_has_a_first_call_column(monkeypatch):
    """benchmarks/kda_gpu.py's chunk table: per row each implementation's ms, peak memory and first
    call's seconds, in the columns its header names (a failed implementation's cells are '-')."""
    monkeypatch.delenv("FLA_TILELANG", raising=False)
    spec = importlib.util.spec_from_file_location("kda_gpu_table_under_test", PATH.parent / "kda_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    impls = ["gdn KDA", "FLA chunk"]
    rows = [dict(shape="s", pass_="fwd", impl="gdn KDA", status="ok", ms=1.0, how="do_bench", peak_gib=0.5,
                 first_s=2.25),
            dict(shape="s", pass_="fwd", impl="FLA chunk", status="FAIL: boom", first_s=9.0)]
    head, rule, line = mod.chunk_table(rows, impls).splitlines()[:3]
    cols = [c.strip() for c in head.strip("|").split("|")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert len(cols) == len(cells) == rule.count("---")
    assert cells[cols.index("first call s gdn KDA / FLA chunk")] == "2.25 / -"
    assert cells[cols.index("peak GiB gdn KDA / FLA chunk")] == "0.50 / -"


def test_caption_says_when_flashqla_reads_a_tilelang_cache(bench, monkeypatch):
    monkeypatch.delenv("TILELANG_CACHE_DIR", raising=False)
    cold = bench.caption(1e12, 1e12, ("gdn", "qla"))
    assert "TileLang's cache" not in cold
    monkeypatch.setenv("TILELANG_CACHE_DIR", "/tmp/tlcache")
    warm = bench.caption(1e12, 1e12, ("gdn", "qla"))
    assert "TileLang's cache at /tmp/tlcache" in warm and "not a cold compile" in warm
    assert "TileLang's cache" not in bench.caption(1e12, 1e12, ("gdn", "fla"))  # no FlashQLA column


def test_variants_are_a_json_list_inline_or_in_a_file(bench, monkeypatch, tmp_path, capsys):
    """--variants takes a JSON list of objects, inline or from a file; anything else is one line of
    usage error (exit status 2) before anything runs."""
    seen = []
    monkeypatch.setattr(bench, "graphed", lambda shapes, peers, specs: seen.append(specs))
    f = tmp_path / "v.json"
    f.write_text('[{}, {"fused_bwd": {"NS": 3}}]')
    for arg in (str(f), '[{}, {"fused_bwd": {"NS": 3}}]'):
        monkeypatch.setattr("sys.argv", ["ops_gpu.py", "--graph", "--shapes", "0", "--variants", arg])
        bench.main()
    assert seen == [[{}, {"fused_bwd": {"NS": 3}}]] * 2
    for bad in ("[1]", "{bad", str(tmp_path / "missing.json")):
        monkeypatch.setattr("sys.argv", ["ops_gpu.py", "--graph", "--variants", bad])
        with pytest.raises(SystemExit) as e:
            bench.main()
        assert e.value.code == 2 and "--variants" in capsys.readouterr().err
