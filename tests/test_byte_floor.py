"""tools/byte_floor.py: the per-kernel floors of one forward + backward."""
from __future__ import annotations

import pytest

from tools import byte_floor as F


def test_floors_scale_with_tokens_and_states_with_chunks():
    """Twice the tokens (whole chunks) moves twice the bytes and FLOPs in every kernel; a partial
    last chunk still stores a whole state per chunk and value head."""
    one, two = F.kernels(2, 1024, 4, 8, 64, 128), F.kernels(2, 2048, 4, 8, 64, 128)
    assert one.keys() == two.keys() == {"kkt_solve", "fused_fwd", "fused_states", "fused_rev", "fused_bwd",
                                        "group_sum"}
    for name in one:
        assert two[name][0] == 2 * one[name][0] and two[name][1] == 2 * one[name][1], name
    full, part = F.kernels(1, 128, 1, 1, 64, 64), F.kernels(1, 65, 1, 1, 64, 64)
    # 65 tokens: two chunks as 128 tokens, so the state pass (which writes h) moves the same state bytes
    assert full["fused_states"][0] - part["fused_states"][0] == 63 * (64 + 64 + 64 + 64) * 2 + 63 * 2 * 4


def test_grouped_heads_read_q_and_k_once_per_key_head_and_sum_dq_dk():
    """Four value heads per key head: group_sum reads the per-value-head dQ and dK and writes one
    per key head; the forward reads q and k once per key head (its bytes grow with HV only through
    v, T⁻¹, γ, β and o); without groups there is no group_sum."""
    assert "group_sum" not in F.kernels(1, 128, 2, 2, 64, 64)
    one, four = F.kernels(1, 128, 2, 2, 64, 64), F.kernels(1, 128, 2, 8, 64, 64)
    per_head = one["fused_fwd"][0] - 2 * 128 * 2 * 64 * 2  # less q and k
    assert four["fused_fwd"][0] == 2 * 128 * 2 * 64 * 2 + 4 * per_head
    assert four["group_sum"] == (2 * 128 * 8 * 64 * 2 + 2 * 128 * 2 * 64 * 2, 0)


def test_fused_backward_bytes_are_its_tensors():
    """fused_bwd at (1, 64, 1, 1, K = 32, V = 64): q, k, δ, dO, dδ, v, h, dh, T⁻¹, γ, β in; dQ, dK, dV,
    dβ, dg out."""
    nb, _ = F.kernels(1, 64, 1, 1, 32, 64)["fused_bwd"]
    rows = 64
    want = (2 * rows * 32 + 4 * rows * 64 + 2 * 32 * 64 + rows * 64 + 2 * rows * 32 + rows * 64) * 2 + 4 * rows * 4
    assert nb == want


def test_table_and_cli(capsys):
    assert F.main(["--shape", "8,2048,16,16,128,128", "--measured", "fused_bwd=430,kkt_solve=96"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("| fused_bwd"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    floor = float(cells[3])
    assert cells[4] == "430" and abs(float(cells[5]) - 430 / floor) < 0.06
    assert "| total |" in out


@pytest.mark.parametrize("argv", [["--shape", "1,2"], ["--shape", "8,2048,16,16,128,x"],
                                  ["--measured", "nope=3"], ["--measured", "fused_bwd"]])
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    assert F.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("byte_floor: ") and "\n" not in err


def test_merged_backward_moves_no_dh_or_ddelta():
    """The merged model replaces fused_rev and fused_bwd by fused_rbwd: the same FLOPs, and their
    bytes less dh and dδ each written once and read once (and less q, k, dO, T⁻¹, γ and β read a
    second time)."""
    two, one = F.kernels(2, 1024, 4, 8, 128, 128), F.kernels(2, 1024, 4, 8, 128, 128, merged=True)
    assert "fused_rev" not in one and "fused_bwd" not in one and one.keys() - two.keys() == {"fused_rbwd"}
    rev, bwd, rb = two["fused_rev"], two["fused_bwd"], one["fused_rbwd"]
    assert rb[1] == rev[1] + bwd[1]
    N, NT = 2 * 1024, 2 * 1024 // 64
    st, tv = NT * 8 * 128 * 128 * 2, N * 8 * 128 * 2
    again = 2 * N * 4 * 128 * 2 + N * 8 * 64 * 2 + 2 * N * 8 * 4  # q, k, T⁻¹, γ, β
    assert rev[0] + bwd[0] - rb[0] == 2 * st + 2 * tv + again + tv  # dh, dδ twice; the second read of q … dO
    assert {k: v for k, v in one.items() if k != "fused_rbwd"} == {k: v for k, v in two.items()
                                                                  if k not in ("fused_rev", "fused_bwd")}


def test_merged_cli_takes_its_kernel_only(capsys):
    assert F.main(["--merged", "--measured", "fused_rbwd=814"]) == 0
    assert "| fused_rbwd |" in capsys.readouterr().out
    assert F.main(["--measured", "fused_rbwd=814"]) == 2
    assert F.main(["--merged", "--measured", "fused_bwd=400"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("byte_floor: --measured: ") for e in err)
