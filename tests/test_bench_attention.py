"""The attention benchmark: its providers, shapes, FLOP model, one call per provider, and the CPU smoke
run with its report (CPU only; the GPU numbers come from bench/run_gpu.sh's attention step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from bench import bench_attention as att  # noqa: E402
from bench import report  # noqa: E402
from tests.child_env import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _config(full=False, dtypes=None):
    opts = {"--full": full, "--bench-dtypes": dtypes}
    return SimpleNamespace(getoption=opts.__getitem__)


def test_providers_put_the_baselines_first_and_ours_last():
    assert att.PROVIDERS[-1] == "fused_flash"
    assert all(att.PROVIDERS.index(b) < att.PROVIDERS.index("fused_naive") for b in att.SPEEDUP_BASES)
    assert att.REPORT_LABELS["bench_attention"]["order"] == att.PROVIDERS
    assert set(att.NOTES) == set(att.PROVIDERS)


def test_gpu_shapes_are_the_issues():
    shapes = att.gpu_shapes()
    assert len(shapes) == len(set(shapes)) == 12
    assert {(s[0], s[-1]) for s in shapes if s[1:4] == (12, 12, 64)} == {(b, n) for b in (1, 8) for n in (128, 512, 1024)}
    assert {s[-1] for s in shapes if s[1:4] == (32, 32, 128)} == {512, 2048, 4096, 16384}
    assert {s[-1] for s in shapes if s[1:3] == (32, 8)} == {4096, 16384}


def test_quick_is_float16_and_full_adds_bfloat16():
    assert {c["dtype"] for c in att.make_cases(_config(), cuda=True)} == {"float16"}
    full = att.make_cases(_config(full=True), cuda=True)
    assert {c["dtype"] for c in full} == {"float16", "bfloat16"} and len(full) == 2 * 12 * 2 * len(att.PROVIDERS)
    cpu = att.make_cases(_config(full=True), cuda=False)
    assert {c["dtype"] for c in cpu} == {"float32"}
    assert att.case_id(cpu[0]) == "sdpa_math-b1-hq4-hkv2-d16-s24-full-float32"


def test_flops_count_causal_as_half():
    assert att.flops((1, 32, 32, 128, 4096), False) == 4 * 32 * 4096 * 4096 * 128
    assert att.flops((1, 32, 32, 128, 4096), True) == 2 * 32 * 4096 * 4096 * 128
    assert att.scores_bytes((1, 32, 32, 128, 16384)) == 4 * 32 * 16384**2  # 34 GB: skipped for math / naive


@pytest.mark.parametrize("provider", ["sdpa_math", "fused_naive", "fused_tiled", "fused_flash_mma", "fused_flash"])
@pytest.mark.parametrize("causal", [False, True])
def test_each_provider_matches_the_reference(provider, causal):
    t = att.make_inputs((1, 4, 2, 16, 24), torch.float32, torch.device("cpu"), seed=1)
    att.check(provider, att.provider_fn(provider, t, causal)(), t, causal)


def test_the_check_rejects_a_wrong_output():
    t = att.make_inputs((1, 4, 2, 16, 24), torch.float32, torch.device("cpu"))
    out = att.provider_fn("sdpa_math", t, True)()
    with pytest.raises(AssertionError, match=r"sdpa_math must match the float64 reference"):
        att.check("sdpa_math", out.flip(2), t, True)


def test_cpu_smoke_run_and_its_report(tmp_path):
    """The benchmark on the CPU (tiny shapes, the op's CPU path), then bench.report."""
    run = tmp_path / "attention.json"
    env = child_env(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "bench/bench_attention.py", "-q", "-rs",
                           "-p", "no:cacheprovider", "--bench-rounds", "3", f"--benchmark-json={run}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "20 passed, 12 skipped" in proc.stdout
    cases = {(tuple(b["extra_info"]["shape"]), b["extra_info"]["causal"], b["extra_info"]["provider"]): b["extra_info"]
             for b in json.loads(run.read_text())["benchmarks"]}
    shape = att.CPU_SHAPES[0]
    assert cases[shape, True, "fused_flash"]["modeled_flops"] == att.flops(shape, True)
    assert {k for k in cases[shape, False, "fused_flash"] if k.startswith("speedup_vs_")} == {"speedup_vs_sdpa_math"}
    assert report.main([str(run), "--out", str(tmp_path / "r"), "--no-plots"]) == 0
    readme = (tmp_path / "r" / "readme.md").read_text()
    assert "fused_flash" in readme


def test_record_on_a_gpu_run_fills_tflops_peak_and_same_run_speedups():
    class Bench:
        group, extra_info = "attention 1x32x32x128x4096 causal float16", {}

    medians = {(Bench.group, "sdpa_flash"): 500.0, (Bench.group, "sdpa_cudnn"): 250.0}
    case = dict(shape=(1, 32, 32, 128, 4096), dtype="float16", causal=True, provider="fused_flash")
    att.record(Bench, case, [400.0, 500.0, 600.0], 33_554_432, 700.0, medians)
    info = Bench.extra_info
    assert info["p50_us"] == 500.0 and info["tflops"] == round(att.flops(case["shape"], True) / 500e-6 / 1e12, 2)
    assert info["pct_of_matmul_peak"] == round(100 * info["tflops"] / 700.0, 1)
    assert info["peak_memory_bytes"] == 33_554_432
    assert (info["speedup_vs_sdpa_flash"], info["speedup_vs_sdpa_cudnn"]) == (1.0, 0.5)
    assert "speedup_vs_sdpa_math" not in info
