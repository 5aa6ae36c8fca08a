"""fused_attn.report on a small saved run (CPU only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fused_attn import report

RUN = Path(__file__).parent / "data" / "bench_softmax_small.json"


def test_report_writes_every_file(tmp_path):
    bytes_txt = tmp_path / "bytes.txt"
    bytes_txt.write_text("DRAM bytes per call ...\nTrue    fused_v1        1       302.1     103.8     175.8\n")
    assert report.main([str(RUN), "--out", str(tmp_path / "r"), "--bytes", str(bytes_txt)]) == 0
    out = tmp_path / "r"
    run = json.loads(RUN.read_text())
    v1 = next(b["extra_info"] for b in run["benchmarks"]
              if b["extra_info"]["provider"] == "fused_v1" and b["extra_info"]["causal"])
    micro = (out / "micro.txt").read_text()
    assert "NVIDIA H200" in micro and run["machine_info"]["fused_attn"]["commit"] in micro
    assert f"{v1['p50_us']:.1f}" in micro
    memory = (out / "memory.txt").read_text()
    assert "measured with Nsight Compute" in memory and "302.1" in memory
    assert "has not" in (out / "gpt2.txt").read_text()
    md = (out / "report.md").read_text()
    assert "| shape [B,H,N,N] |" in md and "![softmax_b8_float16_causal]" in md
    png = out / "softmax_b8_float16_causal.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_speedups_match_the_run(tmp_path):
    report.main([str(RUN), "--out", str(tmp_path), "--no-plots"])
    rows = report.softmax_rows(json.loads(RUN.read_text()))
    lines = (tmp_path / "micro.txt").read_text().splitlines()
    for r in rows:
        if "speedup_vs_eager" in r:
            line = next(ln for ln in lines if ln.startswith("x".join(map(str, r["shape"])))
                        and f" {r['provider']} " in ln and (" yes " in ln) == r["causal"])
            assert f"{r['speedup_vs_eager']:.2f}" in line


def test_report_rejects_a_file_that_is_not_a_benchmark_run(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=r"must be a pytest-benchmark JSON file"):
        report.main([str(bad), "--out", str(tmp_path / "r")])
