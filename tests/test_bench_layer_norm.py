"""The layer_norm benchmark: its providers, shapes, bytes model, one call per provider, and the CPU smoke
run with its report (CPU only; the GPU numbers come from bench/run_gpu.sh's norm step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from bench import bench_layer_norm as ln  # noqa: E402
from bench import report  # noqa: E402
from tests.test_bench_decode import _config  # noqa: E402
from tests.child_env import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_providers_put_the_baselines_first_and_fused_last():
    assert ln.PROVIDERS == ("eager", "compiled", "fused")
    assert ln.REPORT_LABELS["bench_layer_norm"]["order"] == ln.PROVIDERS
    assert set(ln.NOTES) == set(ln.PROVIDERS)


def test_gpu_shapes_are_the_issues():
    shapes = ln.gpu_shapes()
    assert {w for w, _ in shapes} == {768, 4096}
    assert {m for _, m in shapes} == {1, 4, 16, 128, 512, 2048, 4096, 16384}
    assert len(shapes) == len(set(shapes)) == 16


def test_quick_is_float16_and_full_adds_bfloat16():
    quick = ln.make_cases(_config(), cuda=True)
    assert {c["dtype"] for c in quick} == {"float16"} and len(quick) == 16 * 2 * 2 * 3
    assert {(c["norm"], c["residual"]) for c in quick} == {(n, r) for n in ln.NORMS for r in (True, False)}
    full = ln.make_cases(_config(full=True), cuda=True)
    assert {c["dtype"] for c in full} == {"float16", "bfloat16"} and len(full) == 2 * len(quick)
    assert {c["dtype"] for c in ln.make_cases(_config(dtypes="bfloat16"), cuda=True)} == {"bfloat16"}
    cpu = ln.make_cases(_config(full=True), cuda=False)
    assert {c["dtype"] for c in cpu} == {"float32"} and len(cpu) == 2 * 2 * 2 * 3
    assert ln.case_id(cpu[0]) == "eager-layer_norm-add-w64-m3-float32"
    assert ln.case_id(cpu[-1]) == "fused-rms_norm-w96-m5-float32"


def test_modeled_bytes_of_known_shapes():
    # add + LayerNorm, 4096 rows of 768 in float16: x and residual read (6,291,456 B each), weight and
    # bias (1,536 B each); y and h written
    rows = 4096 * 768 * 2
    assert ln.modeled_traffic((768, 4096), torch.float16, "layer_norm", True) == (2 * rows + 2 * 1536, 2 * rows)
    assert ln.modeled_traffic((768, 4096), torch.float16, "layer_norm", False) == (rows + 2 * 1536, rows)
    assert ln.modeled_traffic((4096, 1), torch.bfloat16, "rms_norm", True) == (2 * 8192 + 8192, 2 * 8192)


@pytest.mark.parametrize("norm", ln.NORMS)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("provider", ["eager", "fused"])
def test_each_provider_matches_the_reference(norm, residual, provider):
    t = ln.make_inputs((96, 5), torch.float32, torch.device("cpu"), residual, seed=1)
    out = ln.provider_fn(provider, norm, t)()
    ln.check_call(provider, norm, out, t)
    assert isinstance(out, tuple) == residual


def test_the_check_rejects_a_wrong_output_and_a_wrong_h():
    t = ln.make_inputs((96, 5), torch.float32, torch.device("cpu"), True)
    y, h = ln.provider_fn("eager", "layer_norm", t)()
    with pytest.raises(AssertionError, match=r"eager layer_norm \(rows 0..5\) must match the float64 reference"):
        ln.check_call("eager", "layer_norm", (y * 1.1, h), t)
    with pytest.raises(AssertionError, match=r"eager must return h = x \+ residual bit for bit"):
        ln.check_call("eager", "layer_norm", (y, h + 1), t)


def test_cpu_smoke_run_and_its_report(tmp_path):
    """The command .ci/run's benchmark smoke test runs over bench/, on this file alone, then bench.report."""
    run = tmp_path / "norm.json"
    env = child_env(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "bench/bench_layer_norm.py", "-q", "-rs",
                           "-p", "no:cacheprovider", "--bench-rounds", "3", f"--benchmark-json={run}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "18 passed, 9 skipped" in proc.stdout  # 16 + 8 norm cases, 2 + 1 embedding cases
    runs = json.loads(run.read_text())["benchmarks"]
    cases = {(tuple(b["extra_info"]["shape"]), b["extra_info"]["norm"], b["extra_info"]["residual"],
              b["extra_info"]["provider"]): b["extra_info"] for b in runs if b["name"].startswith("bench_layer_norm[")}
    assert len(cases) == 16
    embed = [b["extra_info"] for b in runs if b["name"].startswith("bench_embedding_layer_norm[")]
    assert [(e["provider"], e["shape"]) for e in embed] == [("eager", [64, 4]), ("fused", [64, 4])]
    assert embed[1]["speedup_vs_eager"] > 0
    info = cases[(64, 3), "layer_norm", True, "fused"]
    assert info["modeled_bytes"] == sum(ln.modeled_traffic((64, 3), torch.float32, "layer_norm", True))
    assert {k for k in info if k.startswith("speedup_vs_")} == {"speedup_vs_eager"}
    assert report.main([str(run), "--out", str(tmp_path / "r"), "--no-plots"]) == 0
    readme = (tmp_path / "r" / "readme.md").read_text()
    assert "| shape [width,M] | dtype | norm | residual | eager us | fused us | x eager |" in readme
    assert "| 64x3 | float32 | layer_norm | yes |" in readme and "| 96x5 | float32 | rms_norm | no |" in readme


def test_record_on_a_gpu_run_fills_bandwidth_floors_and_same_run_speedups():
    class Bench:
        group, extra_info = "add+layer_norm w768 m4096 float16", {}

    timer = SimpleNamespace(same_bytes_copy_us=lambda nbytes: 9.0, spin_cycles=400_000)
    ceilings = {"copy": 3000.0, "read": 2900.0, "write": 3100.0}
    medians = {(Bench.group, "eager"): 30.0, (Bench.group, "compiled"): 15.0}
    case = dict(shape=(768, 4096), dtype="float16", norm="layer_norm", residual=True, provider="fused")
    ln.record(Bench, case, [9.0, 10.0, 11.0], torch.device("cuda"), ceilings, timer, 3.2, medians)
    info = Bench.extra_info
    total = sum(ln.modeled_traffic((768, 4096), torch.float16, "layer_norm", True))
    assert info["modeled_bytes"] == total and info["gbps"] == round(total / 10e-6 / 1e9, 1)
    assert info["same_bytes_copy_us"] == 9.0 and info["pct_of_same_bytes_copy"] == 90.0
    assert (info["speedup_vs_eager"], info["speedup_vs_compiled"]) == (3.0, 1.5)
    assert info["width"] == 768 and info["rows"] == 4096 and medians[(Bench.group, "fused")] == 10.0


def test_bench_bytes_finds_the_layer_norm_interface():
    from bench import bytes as bench_bytes

    mod = bench_bytes.op_module("layer_norm")
    assert mod.bytes_cases(False) == [(True, "eager"), (True, "compiled"), (True, "fused")]
    assert sum(mod.bytes_model("fused", mod.BYTES_SHAPE, torch.float16, True, False)) == 4 * 4096 * 4096 * 2 + 2 * 8192
    with pytest.raises(ValueError, match="backward must be False for layer_norm"):
        mod.bytes_cases(True)


def test_embedding_cases_are_gpt2s_tables_and_every_provider():
    quick = ln.make_embed_cases(_config(), cuda=True)
    assert {c["tables"] for c in quick} == {(50257, 1024)} and {c["shape"][0] for c in quick} == {768}
    assert {c["shape"][1] for c in quick} == set(ln.EMBED_ROWS) and {c["dtype"] for c in quick} == {"float16"}
    assert len(quick) == len(ln.EMBED_ROWS) * len(ln.PROVIDERS) and set(ln.EMBED_NOTES) == set(ln.PROVIDERS)
    assert ln.embed_case_id(quick[0]) == "eager-embed-w768-m1-float16"


def test_embedding_providers_agree_on_the_cpu():
    """eager's chain and the fused op give the same h and y on the CPU's tiny tables (what each
    benchmark case checks before timing)."""
    case = ln.make_embed_cases(_config(), cuda=False)[0]
    t = ln.make_embed_inputs(case, torch.device("cpu"))
    from fused_attn import layer_norm

    y, h = layer_norm(t["wte"], t["weight"], t["bias"], 1e-5, residual=t["wpe"], x_index=t["ids"],
                      residual_index=t["pos"])
    y0, h0 = ln.eager_embedding_layer_norm(t["wte"], t["wpe"], t["ids"], t["pos"], t["weight"], t["bias"], 1e-5)
    assert torch.equal(h, h0)
    torch.testing.assert_close(y, y0)
