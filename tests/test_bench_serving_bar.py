"""bench.serving_bar: the serving bar's counts from bench_decode_attention runs (CPU, synthetic runs)."""

from __future__ import annotations

import json

import pytest

from bench import serving_bar


def _run(tmp_path, name, rows):
    """A pytest-benchmark JSON of (provider, shape, dtype, p50) cases."""
    benches = [{"name": f"bench[{p}]", "extra_info": {"provider": p, "shape": list(s), "dtype": d, "p50_us": t}}
               for p, s, d, t in rows]
    path = tmp_path / name
    path.write_text(json.dumps({"benchmarks": benches}))
    return path


A = (1, 32, 8, 64, 8192)
B = (4, 32, 32, 128, 131072)
SHORT = (1, 12, 12, 64, 1024)


def test_counts_each_mode_and_lists_the_cases_off_the_bar(tmp_path):
    eager = _run(tmp_path, "e.json", [
        ("sdpa_flash", A, "float16", 20.0), ("sdpa_cudnn", A, "float16", 22.0), ("fused", A, "float16", 13.0),
        ("paged", A, "float16", 15.0),  # 1.154x contiguous: outside
        ("sdpa_flash", B, "float16", 1900.0), ("sdpa_cudnn", B, "float16", 1894.0), ("fused", B, "float16", 1905.0),
        ("paged", B, "float16", 1920.0),  # 0.9942x the better SDPA: below
        ("sdpa_flash", SHORT, "float16", 5.0), ("fused", SHORT, "float16", 9.0),  # short: not a serving case
    ])
    graph = _run(tmp_path, "g.json", [
        ("sdpa_cudnn_graph", A, "bfloat16", 20.0), ("fused_graph", A, "bfloat16", 13.0),
        ("paged_graph", A, "bfloat16", 13.3),
    ])
    got = serving_bar.report(serving_bar.load([eager, graph])).splitlines()
    assert got == [
        "eager: at or above the better SDPA backend in 1 of 2; paged within 3% of contiguous in 1 of 2",
        "  below SDPA   0.9942x  B4 32/32 D128 128k float16",
        "  paged        1.1538x  B1 32/8 D64 8k float16",
        "graph: at or above the better SDPA backend in 1 of 1; paged within 3% of contiguous in 1 of 1",
    ]


def test_the_better_sdpa_backend_is_the_faster_one(tmp_path):
    run = _run(tmp_path, "r.json", [("sdpa_flash", A, "float16", 10.0), ("sdpa_cudnn", A, "float16", 30.0),
                                    ("fused", A, "float16", 10.5)])
    assert "below SDPA   0.9524x" in serving_bar.report(serving_bar.load([run]))


def test_bad_runs_are_refused_with_what_was_expected(tmp_path):
    (tmp_path / "x.json").write_text("not json")
    with pytest.raises(ValueError, match=r"runs must be pytest-benchmark JSON files, got '.*x.json'"):
        serving_bar.load([tmp_path / "x.json"])
    short = _run(tmp_path, "s.json", [("fused", SHORT, "float16", 9.0)])
    with pytest.raises(ValueError, match=r"runs must hold bench_decode_attention cases of at least 8192 keys, got "
                                         r"none"):
        serving_bar.load([short])


def test_cli(tmp_path, capsys):
    run = _run(tmp_path, "r.json", [("sdpa_flash", A, "float16", 20.0), ("fused", A, "float16", 13.0)])
    assert serving_bar.main([str(run)]) == 0
    assert capsys.readouterr().out.startswith("eager: at or above the better SDPA backend in 1 of 1;")
    assert serving_bar.main([str(tmp_path / "missing.json")]) == 2
    assert "bench.serving_bar: runs must be pytest-benchmark JSON files" in capsys.readouterr().err
