"""The decode_attention benchmark: its providers, shapes, bytes model, one step per provider, and the
CPU smoke run with its report (CPU only; the GPU numbers come from bench/run_gpu.sh's decode step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from bench import bench_decode_attention as dec  # noqa: E402
from bench import report  # noqa: E402
from tests.child_env import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _config(full=False, dtypes=None):
    opts = {"--full": full, "--bench-dtypes": dtypes}
    return SimpleNamespace(getoption=opts.__getitem__)


def test_providers_put_the_baselines_first_and_fused_last():
    assert dec.PROVIDERS == ("sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "compiled", "gpt2_step",
                             "fused_nosplit", "sdpa_flash_graph", "sdpa_cudnn_graph", "paged_graph", "fused_graph",
                             "paged", "fused")
    # each *_graph provider replays its base's call: the last fused* provider (ours) is still the eager one
    assert {g: dec.base(g) for g in dec.GRAPHED} == {"sdpa_flash_graph": "sdpa_flash", "sdpa_cudnn_graph": "sdpa_cudnn",
                                                    "paged_graph": "paged", "fused_graph": "fused"}
    assert [p for p in dec.PROVIDERS if p.startswith("fused")][-1] == "fused" and dec.base("fused") == "fused"
    # speedups are computed against providers already measured in the group; bench.report's "ours"
    # is the last fused* provider
    assert all(dec.PROVIDERS.index(b) < dec.PROVIDERS.index("fused_nosplit") for b in dec.SPEEDUP_BASES)
    assert dec.REPORT_LABELS["bench_decode_attention"]["order"] == dec.PROVIDERS
    assert set(dec.NOTES) == set(dec.PROVIDERS)
    assert dec.providers((1, 32, 8, 128, 8192)) == tuple(p for p in dec.PROVIDERS if p != "gpt2_step")  # GQA
    short = tuple(p for p in dec.PROVIDERS if p != "paged" and p not in dec.GRAPHED)
    assert dec.providers((1, 12, 12, 64, 128)) == short  # a short cache: no paged, no graph
    assert dec.providers((16, 32, 32, 128, 32768)) == dec.PROVIDERS


def test_gpu_shapes_are_gpt2_llama_gqa_and_the_serving_bar():
    shapes = dec.gpu_shapes()
    assert len(shapes) == len(set(shapes)) == 16 + 46
    assert shapes[:16] == dec.GPT2_SHAPES + dec.LLAMA_SHAPES + dec.GQA_SHAPES  # the headline and story shapes first
    assert (1, 12, 12, 64, 1024) in shapes and (16, 12, 12, 64, 128) in shapes
    assert {s[-1] for s in shapes if s[1:4] == (32, 32, 128)} == {1024, 8192, 32768, 131072}
    # the serving bar: MHA 32/32 and GQA 32/8, 64/8; D64 and D128; B 1, 4, 16; 8k, 32k and 128k keys
    serving = {s for s in shapes if s[-1] >= 8192}
    assert serving == set(dec.SERVING_SHAPES) and len(serving) == 3 * 2 * 3 * 3
    assert {s[1:3] for s in serving} == {(32, 32), (32, 8), (64, 8)} and {s[3] for s in serving} == {64, 128}
    assert {s[0] for s in serving} == {1, 4, 16} and {s[-1] for s in serving} == {8192, 32768, 131072}
    # the story's long shapes keep every provider; the new serving shapes measure the bar's (and sdpa)
    assert dec.providers((16, 32, 8, 128, 32768)) == tuple(p for p in dec.PROVIDERS if p != "gpt2_step")
    assert dec.providers((4, 32, 32, 128, 32768)) == dec.SERVING_PROVIDERS
    assert dec.providers((16, 64, 8, 64, 131072)) == dec.SERVING_PROVIDERS


def _selected(expression: str, cases: list[dict]) -> list[dict]:
    """The cases ``pytest -k expression`` keeps (a keyword matches a substring of the item's name,
    ignoring case)."""
    from _pytest.mark.expression import Expression

    compiled = Expression.compile(expression)
    return [c for c in cases
            if compiled.evaluate(lambda k, c=c: k.lower() in f"bench_decode_attention[{dec.case_id(c)}]".lower())]


@pytest.mark.parametrize("expression, providers", [
    ("SERVING_K", ("sdpa_flash", "sdpa_cudnn", "paged", "fused")),
    ("SERVING_GRAPH_K", ("sdpa_flash_graph", "sdpa_cudnn_graph", "paged_graph", "fused_graph"))])
def test_the_serving_selections_are_the_bar_in_both_dtypes_eager_and_captured(expression, providers):
    """SERVING_K: the bar's eager providers; SERVING_GRAPH_K: the same captured in CUDA graphs. Neither selects
    a case of the other, and both are the commands run_gpu.sh documents."""
    full = dec.make_cases(_config(full=True), cuda=True)
    picked = _selected(getattr(dec, expression), full)
    assert len(picked) == 54 * 2 * 4 == 432
    assert {(c["shape"], c["dtype"], c["provider"]) for c in picked} == {
        (s, d, p) for s in dec.SERVING_SHAPES for d in ("float16", "bfloat16") for p in providers}
    assert getattr(dec, expression) in (ROOT / "bench" / "run_gpu.sh").read_text()


def test_a_captured_call_keeps_its_transient_memory_for_the_case():
    gqa, mha = (16, 64, 8, 128, 131072), (1, 32, 32, 128, 8192)
    kv = dec.kv_bytes(gqa, torch.float16)
    check = 2 * (3 * 8 + 64) * 131072 * 128 * 8
    assert dec.peak_bytes("sdpa_cudnn", gqa, torch.float16) == kv + max(kv * 8, check)
    assert dec.peak_bytes("sdpa_cudnn_graph", gqa, torch.float16) == kv + kv * 8 + check  # the repeat, held
    for g in ("fused_graph", "paged_graph", "sdpa_flash_graph"):  # nothing of the cache's size held by the graph
        assert dec.peak_bytes(g, mha, torch.float16) == dec.peak_bytes(dec.base(g), mha, torch.float16)
    assert dec.bytes_model("paged_graph", mha, torch.float16, False, False) == dec.bytes_model(
        "paged", mha, torch.float16, False, False)
    assert dec.NOTES["fused_graph"].startswith(dec.NOTES["fused"]) and "CUDA graph" in dec.NOTES["fused_graph"]


def test_peak_memory_drops_the_peers_copies_that_do_not_fit_an_h200():
    free = 140e9  # an H200's free memory, conservatively
    fits = {(p, s) for s in dec.gpu_shapes() for p in dec.providers(s)
            if dec.peak_bytes(p, s, torch.float16) <= dec.MAX_FRACTION_OF_FREE * free}
    dropped = {(p, s) for s in dec.gpu_shapes() for p in dec.providers(s)} - fits
    assert dropped == {("sdpa", (16, 32, 32, 128, 131072)), ("sdpa", (16, 64, 8, 128, 131072))}
    # the largest case that runs: paged at B16 32/32 D128 L128k, pools beside the caches (34 GB each) and the
    # check's float64 copies of one sequence (K and V, scatter, where, repeat: 34 GB)
    assert dec.peak_bytes("paged", (16, 32, 32, 128, 131072), torch.float16) == 3 * 34_359_738_368
    assert dec.peak_bytes("fused", (1, 32, 8, 128, 8192), torch.float16) == (
        dec.kv_bytes((1, 32, 8, 128, 8192), torch.float16) + 2 * (3 * 8 + 32) * 8192 * 128 * 8)


def test_quick_is_float16_and_full_adds_bfloat16():
    assert {c["dtype"] for c in dec.make_cases(_config(), cuda=True)} == {"float16"}
    full = dec.make_cases(_config(full=True), cuda=True)
    assert {c["dtype"] for c in full} == {"float16", "bfloat16"}
    # no gpt2_step for the 4 GQA shapes, no paged for the 8 shapes below L 8192; the 46 new serving shapes with
    # SERVING_PROVIDERS
    # (and none of the four *_graph providers there)
    assert len(full) == 2 * (16 * len(dec.PROVIDERS) - 4 - 8 * 5 + 46 * len(dec.SERVING_PROVIDERS)) == 1156
    assert {c["dtype"] for c in dec.make_cases(_config(dtypes="bfloat16"), cuda=True)} == {"bfloat16"}
    cpu = dec.make_cases(_config(full=True), cuda=False)
    assert {c["dtype"] for c in cpu} == {"float32"} and len(cpu) == 2 * (len(dec.PROVIDERS) - len(dec.GRAPHED)) - 1
    assert dec.case_id(cpu[0]) == "sdpa-b2-hq4-hkv2-d16-l32-float32"
    assert dec.case_id(cpu[-1]) == "fused-b1-hq2-hkv2-d16-l32-float32"


def test_modeled_bytes_of_known_shapes():
    # GPT-2 small, B1 L1024: K + V 3,145,728 B; q and out 12 x 64 x 2 = 1,536 B each; k_new + v_new 3,072 B
    # read and appended
    assert dec.kv_bytes((1, 12, 12, 64, 1024), torch.float16) == 3_145_728
    assert dec.modeled_traffic((1, 12, 12, 64, 1024), torch.float16) == (3_145_728 + 1_536 + 3_072, 1_536 + 3_072)
    assert dec.kv_bytes((1, 32, 32, 128, 8192), torch.float16) == 134_217_728
    assert dec.kv_bytes((16, 32, 32, 128, 32768), torch.float16) == 8_589_934_592  # the largest case: 8.6 GB
    # GQA reads the 8 kv heads only, but q and out have 32 heads
    read, write = dec.modeled_traffic((1, 32, 8, 128, 8192), torch.bfloat16)
    assert read == 2 * 8 * 8192 * 128 * 2 + 32 * 128 * 2 + 2 * 8 * 128 * 2
    assert write == 32 * 128 * 2 + 2 * 8 * 128 * 2


def test_page_inputs_hold_the_same_cache_in_shuffled_pages():
    t = dec.make_inputs((2, 4, 2, 16, 64), torch.float32, torch.device("cpu"))
    dec.page_inputs(t, 16)
    table = t["block_table"]
    assert table.dtype == torch.int32 and table.shape == (2, 4) and t["k_pool"].shape == (8, 2, 16, 16)
    assert sorted(table.flatten().tolist()) == list(range(8)) and table.flatten().tolist() != list(range(8))
    for b in range(2):
        for blk in range(4):
            page = int(table[b, blk])
            assert torch.equal(t["k_pool"][page], t["k_cache"][b, :, 16 * blk:16 * (blk + 1)])
            assert torch.equal(t["v_pool"][page], t["v_cache"][b, :, 16 * blk:16 * (blk + 1)])
    assert dec.modeled_traffic((2, 4, 2, 16, 64), torch.float32, 16)[0] == (
        dec.modeled_traffic((2, 4, 2, 16, 64), torch.float32)[0] + 2 * 4 * 4)


def test_inputs_hold_a_uniform_length_batch_whose_mask_covers_the_cache():
    t = dec.make_inputs((2, 4, 2, 16, 32), torch.float32, torch.device("cpu"))
    assert t["k_cache"].shape == (2, 2, 32, 16) and t["q"].shape == (2, 4, 1, 16)
    assert t["cache_seqlens"].tolist() == [31, 31] and t["cache_seqlens"].dtype == torch.int32
    assert t["input_pos"].tolist() == [31]
    assert t["mask"].shape == (2, 1, 1, 32) and bool(t["mask"].all())  # max_len = L: every slot is valid


@pytest.mark.parametrize("provider,shape", [(p, (2, 4, 2, 16, 32)) for p in ("sdpa", "sdpa_flash", "fused_nosplit",
                                                                           "paged", "fused")]
                         + [("gpt2_step", (2, 2, 2, 16, 32))])
def test_each_step_appends_matches_the_reference_and_is_idempotent(provider, shape):
    t = dec.make_inputs(shape, torch.float32, torch.device("cpu"), seed=1)
    if provider == "paged":
        dec.page_inputs(t, dec.PAGE_SIZE)
    untouched = t["k_cache"][:, :, :31].clone()
    fn = dec.provider_fn(provider, t)
    first = fn()
    dec.check_step(provider, first, t)
    cache = t["k_cache"].clone()
    assert torch.equal(fn(), first) and torch.equal(t["k_cache"], cache)  # same slot, same output
    assert torch.equal(t["k_cache"][:, :, :31], untouched)


def test_the_check_rejects_a_wrong_output_and_a_missing_append():
    t = dec.make_inputs((2, 4, 2, 16, 32), torch.float32, torch.device("cpu"))
    out = dec.provider_fn("sdpa", t)()
    with pytest.raises(AssertionError, match=r"sdpa \(sequence 1\) must match the float64 reference"):
        dec.check_step("sdpa", torch.cat([out[:1], torch.zeros_like(out[1:])]), t)
    t["v_cache"][:, :, 31] = 0
    with pytest.raises(AssertionError, match=r"sdpa must write v_new at slots \[31\] of v_cache"):
        dec.check_step("sdpa", out, t)


def test_cpu_smoke_run_and_its_report(tmp_path):
    """The command .ci/run's benchmark smoke test runs over bench/, on this file alone, then bench.report."""
    run = tmp_path / "decode.json"
    env = child_env(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "bench/bench_decode_attention.py", "-q", "-rs",
                           "-p", "no:cacheprovider", "--bench-rounds", "3", f"--benchmark-json={run}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "9 passed, 8 skipped" in proc.stdout
    cases = {(tuple(b["extra_info"]["shape"]), b["extra_info"]["provider"]): b["extra_info"]
             for b in json.loads(run.read_text())["benchmarks"]}
    gqa, mha = dec.CPU_SHAPES
    assert set(cases) == {(gqa, p) for p in ("sdpa", "fused_nosplit", "paged", "fused")} | {
        (mha, p) for p in ("sdpa", "gpt2_step", "fused_nosplit", "paged", "fused")}
    # the paged provider's bytes add its block_table: B x L / 16 int32 entries
    assert cases[gqa, "paged"]["modeled_bytes"] == sum(dec.modeled_traffic(gqa, torch.float32)) + 2 * 2 * 4
    assert cases[gqa, "fused"]["modeled_bytes"] == sum(dec.modeled_traffic(gqa, torch.float32))
    assert {k for k in cases[mha, "fused"] if k.startswith("speedup_vs_")} == {"speedup_vs_sdpa",
                                                                               "speedup_vs_gpt2_step"}
    assert "speedup_vs_sdpa" not in cases[gqa, "sdpa"]
    assert report.main([str(run), "--out", str(tmp_path / "r"), "--no-plots"]) == 0
    readme = (tmp_path / "r" / "readme.md").read_text()
    assert ("| shape [B,Hq,Hkv,D,L] | dtype | sdpa us | gpt2_step us | fused_nosplit us | paged us | fused us | "
            "x sdpa | x gpt2_step |") in readme
    assert "| 2x4x2x16x32 | float32 |" in readme and "| 1x2x2x16x32 | float32 |" in readme


def test_record_on_a_gpu_run_fills_bandwidth_floors_and_same_run_speedups():
    class Bench:
        group, extra_info = "decode 1x12x12x64x1024 float16", {}

    timer = SimpleNamespace(same_bytes_copy_us=lambda nbytes: 2.5, spin_cycles=400_000)
    ceilings = {"copy": 3000.0, "read": 2900.0, "write": 3100.0}
    medians = {(Bench.group, "sdpa"): 20.0, (Bench.group, "compiled"): 10.0}
    case = dict(shape=(1, 12, 12, 64, 1024), dtype="float16", provider="fused")
    dec.record(Bench, case, [4.0, 5.0, 6.0], torch.device("cuda"), ceilings, timer, 3.2, medians)
    info = Bench.extra_info
    total = sum(dec.modeled_traffic(case["shape"], torch.float16))
    assert info["modeled_bytes"] == total == 3_154_944 and info["kv_bytes"] == 3_145_728
    assert info["p50_us"] == 5.0 and info["gbps"] == round(total / 5e-6 / 1e9, 1)
    assert info["pct_of_copy_bw"] == round(100 * info["gbps"] / 3000.0, 1)
    assert info["same_bytes_copy_us"] == 2.5 and info["pct_of_same_bytes_copy"] == 50.0
    assert info["launch_floor_us"] == 3.2 and info["max_len"] == 1024
    assert (info["speedup_vs_sdpa"], info["speedup_vs_compiled"]) == (4.0, 2.0)
    assert "speedup_vs_gpt2_step" not in info and medians[(Bench.group, "fused")] == 5.0


def test_bench_bytes_finds_the_decode_interface():
    from bench import bytes as bench_bytes

    mod = bench_bytes.op_module("decode_attention")
    assert [p for _, p in mod.bytes_cases(False)] == ["sdpa", "compiled", "fused_nosplit", "paged", "fused"]
    assert sum(mod.bytes_model("fused", mod.BYTES_SHAPE, torch.float16, False, False)) == (
        134_217_728 + 2 * (32 * 128 * 2 + 2 * 32 * 128 * 2))
    with pytest.raises(ValueError, match="backward must be False for decode_attention"):
        mod.bytes_cases(True)
