"""The linear and mlp benchmarks: providers, shapes, bytes / FLOP models, one call per provider against the
reference, and the CPU smoke run with its report (CPU only; the GPU numbers come from bench/run_gpu.sh's
linear step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from bench import bench_linear as lin  # noqa: E402
from bench import bench_mlp as mlp  # noqa: E402
from bench import report  # noqa: E402
from tests.test_bench_decode import _config  # noqa: E402
from tests.child_env import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_providers_put_the_baselines_first_and_fused_last():
    assert lin.PROVIDERS == mlp.PROVIDERS == ("eager", "compiled", "fused")
    for mod in (lin, mlp):
        assert set(mod.NOTES) == set(mod.PROVIDERS)
    assert lin.REPORT_LABELS["bench_linear"]["order"] == lin.LN_PROVIDERS
    assert lin.LN_PROVIDERS == lin.CHAIN_PROVIDERS + ("fused", "folded")
    assert set(lin.LN_NOTES) == set(lin.LN_PROVIDERS) and set(lin.CHAIN_NOTES) == set(lin.CHAIN_PROVIDERS)
    # bench.report's "ours" is the last fused* provider: fused, whose cases cover every group
    assert [p for p in lin.LN_PROVIDERS if p.startswith("fused")][-1] == "fused"


def test_gpu_cases_are_the_issues():
    all_cases = lin.make_cases(_config(), cuda=True)
    cases = [c for c in all_cases if c["op"] == "linear"]
    ln = [c for c in all_cases if c["op"] == "ln_linear"]
    assert {c["shape"] for c in ln} == {(768, 2304), (768, 3072), (768, 50257)} and len(ln) == (3 * 3 + 2) * 5
    assert {c["m"] for c in ln if c["shape"] != (768, 50257)} == {1, 4, 16}
    assert {c["m"] for c in ln if c["shape"] == (768, 50257)} == {1, 4, 16, 64, 2048}  # the lm_head: cuBLAS's rows too
    assert lin.case_id(ln[0]) == "eager-ln-k768-n2304-m1-float16"
    assert lin.group(ln[0]) == "ln+linear 768x2304 m1 float16"
    # the fold sits in its peers' groups: every (shape, m, dtype) of the ln+linear cases, one group
    folded = [c for c in ln if c["provider"] == "folded"]
    assert {(c["shape"], c["m"]) for c in folded} == {(c["shape"], c["m"]) for c in ln} and len(folded) == 11
    assert lin.case_id(folded[0]) == "folded-ln-k768-n2304-m1-float16" and lin.group(folded[0]) == lin.group(ln[0])
    chain = [c for c in all_cases if c["op"] == "chain"]
    assert {c["shape"] for c in chain} == {(768, 3072), (768, 2304)} and len(chain) == 2 * 3 * 3
    assert lin.case_id(chain[0]) == "eager-chain-k768-n3072-m1-float16"
    assert lin.group(chain[0]) == "chain 768x3072 m1 float16"
    assert {c["shape"] for c in cases} == {(768, 2304), (768, 3072), (3072, 768), (768, 768), (4096, 11008),
                                           (11008, 4096), (4096, 4096)}
    assert {c["m"] for c in cases} == {1, 4, 16, 128, 512, 2048, 4096}
    assert len(cases) == 7 * 7 * 3 and {c["dtype"] for c in cases} == {"float16"}
    assert {c["dtype"] for c in lin.make_cases(_config(full=True), cuda=True)} == {"float16", "bfloat16"}
    m_cases = mlp.make_cases(_config(), cuda=True)
    assert {c["shape"] for c in m_cases} == {(768, 3072), (4096, 11008)} and len(m_cases) == 2 * 7 * 3
    assert mlp.model_of((4096, 11008)) == ("llama2_7b", "swiglu")
    assert lin.case_id(cases[0]) == "eager-k768-n2304-m1-float16"


def test_modeled_bytes_and_flops_of_known_shapes():
    # GPT-2 c_fc at M = 1 in float16: the weight 768 x 3072 x 2 B dominates
    read, write = lin.modeled_traffic(768, 3072, 1, torch.float16)
    assert read == (768 * 3072 + 768 + 3072 + 3072) * 2 and write == 3072 * 2
    assert lin.chain_modeled_traffic(768, 3072, 4, torch.float16) == (
        (768 * 768 + 3072 * 768 + 4 * 768 + 768 + 3072 + 4 * 768 + 2 * 768) * 2, (4 * 768 + 4 * 3072) * 2)
    assert lin.ln_modeled_traffic(768, 50257, 1, torch.float16) == ((768 * 50257 + 768 + 50257 + 2 * 768) * 2,
                                                                     50257 * 2)
    assert lin.flops(4096, 11008, 16) == 2 * 16 * 4096 * 11008
    t = mlp.make_inputs(32, 48, "swiglu", 3, torch.float32, torch.device("cpu"))
    assert t["w_fc"].shape == (96, 32) and t["b_fc"] is None
    assert mlp.modeled_traffic(t) == ((96 * 32 + 32 * 48 + 2 * 3 * 32) * 4, 3 * 32 * 4)


@pytest.mark.parametrize("m", [1, 20])
def test_each_provider_matches_the_reference_on_the_cpu(m):
    t = lin.make_inputs(64, 48, m, torch.float32, torch.device("cpu"), seed=1)
    for p in ("eager", "fused"):
        lin.check(p, lin.provider_fn(p, t)(), t)
    for p in ("eager", "unfolded", "fused", "folded"):
        lin.ln_check(p, lin.ln_provider_fn(p, t)(), t)
    for p in ("eager", "unfolded"):
        lin.chain_check(p, lin.chain_provider_fn(p, t)(), t)
    for act in ("gelu_tanh", "swiglu"):
        t = mlp.make_inputs(32, 48, act, m, torch.float32, torch.device("cpu"))
        for p in ("eager", "fused"):
            mlp.check(p, mlp.provider_fn(p, t)(), t)


def test_the_check_rejects_a_wrong_output():
    t = lin.make_inputs(64, 48, 4, torch.float32, torch.device("cpu"))
    out = lin.provider_fn("eager", t)()
    out[-1] = 0
    with pytest.raises(AssertionError, match=r"eager \(row 3\) must match the float64 reference"):
        lin.check("eager", out, t)


def test_the_ln_check_rejects_a_fold_that_drops_the_norms_affine():
    """The folded provider's check is against layer_norm(x) with the norm's weight and bias: the weightless
    norm with the unfolded W and b (a fold that was never applied) fails it."""
    from fused_attn import linear

    t = lin.make_inputs(64, 48, 1, torch.float32, torch.device("cpu"))
    with pytest.raises(AssertionError, match=r"folded \(row 0\) must match the float64 reference"):
        lin.ln_check("folded", linear(t["x"], t["w"], t["b"], norm="layer_norm", eps=lin.LN_EPS), t)


def test_record_on_a_gpu_run_fills_bandwidth_matmul_floors_and_speedups():
    class Bench:
        group, extra_info = "linear 768x3072 m1 float16", {}

    timer = SimpleNamespace(same_bytes_copy_us=lambda nbytes: 2.5, spin_cycles=400_000)
    ceilings = {"copy": 3000.0, "read": 2900.0, "write": 3100.0}
    medians = {(Bench.group, "eager"): 10.0, (Bench.group, "compiled"): 6.0}
    case = dict(shape=(768, 3072), m=1, dtype="float16", provider="fused")
    lin.record(Bench, case, [2.0, 3.0, 4.0], torch.device("cuda"), ceilings, timer, 2.0, 700.0, medians)
    info = Bench.extra_info
    total = sum(lin.modeled_traffic(768, 3072, 1, torch.float16))
    assert info["modeled_bytes"] == total and info["gbps"] == round(total / 3e-6 / 1e9, 1)
    assert info["pct_of_same_bytes_copy"] == round(100 * 2.5 / 3.0, 1) and info["bound"] == "memory"
    assert info["tflops"] == round(2 * 768 * 3072 / 3e-6 / 1e12, 2) and info["matmul_peak_tflops"] == 700.0
    assert (info["speedup_vs_eager"], info["speedup_vs_compiled"]) == (round(10 / 3, 3), 2.0)


def test_cpu_smoke_run_and_its_report(tmp_path):
    run = tmp_path / "linear.json"
    env = child_env(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "bench/bench_linear.py", "bench/bench_mlp.py", "-q", "-rs",
                           "-p", "no:cacheprovider", "--bench-rounds", "3", f"--benchmark-json={run}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "18 passed, 8 skipped" in proc.stdout
    benches = json.loads(run.read_text())["benchmarks"]
    assert {b["extra_info"]["provider"] for b in benches} == {"eager", "unfolded", "fused", "folded"}
    ln = {b["extra_info"]["provider"]: b["extra_info"] for b in benches if b["group"].startswith("ln+linear")}
    assert set(ln) == {"eager", "unfolded", "fused", "folded"}  # one group; the same modeled bytes for all
    assert {e["modeled_bytes"] for e in ln.values()} == {sum(lin.ln_modeled_traffic(64, 48, 1, torch.float32))}
    assert "speedup_vs_fused" in ln["folded"]
    chain = {b["extra_info"]["provider"]: b["extra_info"] for b in benches if b["group"].startswith("chain")}
    assert set(chain) == {"eager", "unfolded"}
    assert {e["modeled_bytes"] for e in chain.values()} == {sum(lin.chain_modeled_traffic(64, 48, 4, torch.float32))}
    assert "speedup_vs_eager" in chain["unfolded"]
    assert report.main([str(run), "--out", str(tmp_path / "r"), "--no-plots"]) == 0
    readme = (tmp_path / "r" / "readme.md").read_text()
    assert "| K x N, M | dtype | op | eager us | unfolded us | fused us | folded us | x eager | x unfolded |" in readme
    # each group's rows say which group they are (linear and ln+linear share a shape here)
    rows = [ln for ln in readme.splitlines() if ln.startswith("| 64x48x1 | float32 |")]
    assert {ln.split("|")[3].strip() for ln in rows} == {"linear", "ln_linear"}, rows
    assert "| d_model x hidden x M | dtype | eager us | fused us | x eager |" in readme
