"""The figures the ``generate`` CLI and the benchmark JSON print, from fixed inputs: Result's totals and
tokens/s (the batch factor), the nearest-rank percentile against its textbook definition, summary(),
the timing split of the marks, bench.harness's percentiles, roofline, GB/s and speedups, and the
GPT-2 benchmark's floors; and the CLI generating exactly up to ``n_positions`` with its sampling
options passed through."""

from __future__ import annotations

import math
import re

import pytest
import torch

from bench import harness
from fused_attn import generate as gen_cli
from fused_attn.generate import Result, _result, nearest_rank, summary


def test_result_totals_and_tokens_per_s_count_every_row():
    r = Result("x", torch.zeros(4, 5), ttft_s=0.5, step_s=[0.25, 0.25])
    assert r.total_s == 1.0 and r.new_tokens == 3
    assert r.tokens_per_s(1) == 3.0
    assert r.tokens_per_s(4) == 12.0


def textbook_percentile(values, percent: int):
    """The smallest value with at least percent % of the values at or below it (integer arithmetic)."""
    return min(v for v in values if 100 * sum(x <= v for x in values) >= percent * len(values))


@pytest.mark.parametrize("n", [1, 2, 7, 10, 19, 20, 21, 100, 101])
@pytest.mark.parametrize("percent", [5, 7, 50, 95])
def test_nearest_rank_is_the_textbook_percentile(n, percent):
    values = [(7 * i) % n + 0.5 * i for i in range(n)]  # distinct, not sorted
    assert nearest_rank(values, percent / 100) == textbook_percentile(values, percent)


def test_nearest_rank_of_nothing_is_nan():
    assert math.isnan(nearest_rank([], 0.95))


def test_summary_prints_ttft_percentiles_and_batch_tokens_per_s():
    steps = [0.001] * 19 + [0.009]  # p95 of 20 gaps is the 19th: 1 ms, not the slowest
    r = Result("graph", torch.zeros(2, 3), ttft_s=0.010, step_s=steps)
    line = summary(r, batch=2)
    figures = dict(re.findall(r"(TTFT|p50|p95) +([\d.]+) ms", line))
    assert figures == {"TTFT": "10.00", "p50": "1.000", "p95": "1.000"}
    assert line.endswith(f"{2 * 21 / (0.010 + sum(steps)):9.1f} tokens/s")


def test_result_splits_the_marks_into_ttft_and_gaps():
    r = _result("b", torch.zeros(1, 4), [10.0, 10.5, 10.6, 10.7, 11.0], wall_s=1.1)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.step_s == pytest.approx([0.1, 0.4])  # the last gap runs to the end mark
    assert r.new_tokens == 3 and r.wall_s == 1.1
    one = _result("b", torch.zeros(1, 2), [1.0, 1.25, 1.5], wall_s=0.5)
    assert one.ttft_s == pytest.approx(0.5) and one.step_s == [] and one.new_tokens == 1


def test_bench_percentiles_roofline_bandwidth_and_speedups():
    times = [float(t) for t in range(1, 22)]  # 1 .. 21 us
    p = harness.percentiles(times)
    assert p == {"p5_us": 2.0, "p50_us": 11.0, "p95_us": 20.0}  # inclusive quantiles: 1 + 20 q
    assert harness.percentiles([4.0]) == {"p5_us": 4.0, "p50_us": 4.0, "p95_us": 4.0}
    ceilings = {"copy": 4000.0, "read": 5000.0, "write": 2000.0}  # GB/s
    assert harness.roofline_us(4_000_000, 1_000_000, ceilings) == pytest.approx(1.25)  # 5 MB at the copy rate
    assert harness.roofline_us(1_000_000, 4_000_000, ceilings) == pytest.approx(2.0)  # 4 MB at the write rate
    info = harness.bandwidth_info(3_000_000, 1_000_000, 2.0, None, None, None)
    assert info == dict(modeled_read_bytes=3_000_000, modeled_write_bytes=1_000_000, modeled_bytes=4_000_000,
                        gbps=2000.0)
    medians = {("g", "eager"): 30.0, ("g", "compiled"): 12.0}
    assert harness.same_run_speedups(medians, "g", "fused_attn", 10.0, ("eager", "compiled", "absent")) == {
        "speedup_vs_eager": 3.0, "speedup_vs_compiled": 1.2}
    assert medians[("g", "fused_attn")] == 10.0


def test_bench_gpt2_copy_floor():
    from bench.bench_gpt2 import copy_ms

    assert copy_ms(2_000_000_000, 4000.0) == pytest.approx(0.5)  # 2 GB at 4000 GB/s


@pytest.fixture
def tiny_checkpoint(monkeypatch):
    """gpt2-random replaced by a 2-layer GPT-2 with 16 positions (the CLI loads it by name)."""
    transformers = pytest.importorskip("transformers")
    import fused_attn.gpt2

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                                      initializer_range=0.5)
        model = transformers.GPT2LMHeadModel(cfg).eval()
    monkeypatch.setattr(fused_attn.gpt2, "load_hf_model", lambda name: model)
    return model


def _continuation(out: str) -> list[int]:
    return [int(t) for t in re.search(r"continuation of row 0: \[([\d, ]*)\]", out).group(1).split(", ")]


@pytest.mark.parametrize("backend", ["hf-eager", "graph"])
def test_cli_generates_exactly_up_to_n_positions(backend, tiny_checkpoint, capsys):
    # 4 prompt tokens + 2 of left padding (batch 3) + 10 new = 16 positions
    argv = ["--prompt-ids", "5,6,7,8", "--batch-size", "3", "--dtype", "float32", "--backend", backend]
    assert gen_cli.main(argv + ["--max-new-tokens", "10"]) == 0
    out = capsys.readouterr().out
    assert len(_continuation(out)) == 10
    with pytest.raises(SystemExit) as exc:
        gen_cli.main(argv + ["--max-new-tokens", "11"])
    assert exc.value.code == 2
    assert "must fit in gpt2-random's 16 positions, got 4 + 2 + 11 = 17" in capsys.readouterr().err


def test_cli_passes_temperature_top_k_and_seed(tiny_checkpoint, capsys):
    from fused_attn.gpt2 import GPT2

    argv = ["--prompt-ids", "5,6,7,8", "--dtype", "float32", "--backend", "graph", "--max-new-tokens", "8",
            "--temperature", "1.5", "--top-k", "20", "--seed", "3"]
    assert gen_cli.main(argv) == 0
    got = _continuation(capsys.readouterr().out)
    # The CLI runs on the GPU where there is one: the same device and path here, so the same draws.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ids = torch.tensor([[5, 6, 7, 8]], device=device)
    m = GPT2.from_hf(tiny_checkpoint, device=device, backends=gen_cli.GRAPH_BACKENDS["graph"])
    kw = dict(max_new_tokens=8, temperature=1.5, top_k=20, use_graph=device.type == "cuda")
    want = m.generate(ids, torch.ones_like(ids), seed=3, **kw)
    assert got == want[0, 4:].tolist()
    other = m.generate(ids, torch.ones_like(ids), seed=4, **kw)
    assert other[0, 4:].tolist() != got
