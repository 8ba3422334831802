"""benchmarks/train.py's step profile sums kernels by part of the step from their names: cuBLAS
and CUTLASS products, gdn's chunk kernels, the glue kernels, the optimizer, copies; an unknown
name is "other"; the parts' shares add up to one. Its --config applies launch settings."""
from __future__ import annotations

import importlib.util
from pathlib import Path

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "train.py"


def _train():
    spec = importlib.util.spec_from_file_location("train_bench_under_test", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_names_by_part():
    t = _train()
    assert t.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matrix products"
    assert t.kind_of("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT") == "matrix products"
    assert t.kind_of("fused_bwd_kernel") == "chunk op"
    assert t.kind_of("kkt_solve_kernel") == "chunk op"
    assert t.kind_of("rmsnorm_fwd_kernel") == "glue kernels"
    assert t.kind_of("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdam>") == "optimizer"
    assert t.kind_of("Memcpy DtoD (Device -> Device)") == "copies and fills"
    assert t.kind_of("void at::native::vectorized_elementwise_kernel<4, ...>") == "other elementwise and reductions"
    assert t.kind_of("mystery_kernel") == "other"


def test_parts_sum_and_order():
    t = _train()
    rows = t.by_kind([("fused_bwd_kernel", 3.0), ("sm90_xmma_gemm", 5.0), ("kkt_solve_kernel", 1.0),
                      ("mystery", 1.0)])
    assert [k for k, _, _ in rows] == ["matrix products", "chunk op", "other"]
    assert [ms for _, ms, _ in rows] == [5.0, 4.0, 1.0]
    assert abs(sum(sh for _, _, sh in rows) - 1.0) < 1e-12


def test_config_applies_launch_settings_and_rejects_unknown_ones(capsys):
    """--config updates gdn's launch tables before the model is built; a setting the tables do not
    have is a one-line usage error (exit status 2), not a silent run at the defaults."""
    import pytest

    from gdn.ops import tuning

    t = _train()
    before = dict(tuning.OTHER["swiglu"])
    try:
        t.parse_args(["--config", '{"other.swiglu": {"num_warps": 2}}'])
        assert tuning.OTHER["swiglu"]["num_warps"] == 2
    finally:
        tuning.OTHER["swiglu"].clear()
        tuning.OTHER["swiglu"].update(before)
    with pytest.raises(SystemExit) as e:
        t.parse_args(["--config", '{"other.swiglu": {"warps": 2}}'])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--config" in err[-1] and "warps" in err[-1]
