"""bench.bytes (the ncu runner) and the softmax bytes model of bench/bench_softmax.py (CPU only, ncu mocked)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from bench import bench_softmax as bs
from bench import bytes as fb

SHAPE = (2, 3, 4, 4)  # 96 elements; causal: 10 visible per [4, 4] slice, 60 in all
N, VIS, MASK = 96, 60, 16


def test_providers_per_case():
    assert bs.providers(True) == ("eager", "compiled", "compiled_iota", "fused_v0", "fused_v1")
    assert "compiled_iota" not in bs.providers(False)
    assert bs.providers(True, backward=True) == bs.providers(False, backward=True) == ("eager", "compiled", "fused")


@pytest.mark.parametrize("provider,causal,expected", [
    ("eager", True, (3 * N * 2 + MASK, 3 * N * 2)), ("eager", False, (2 * N * 2, 2 * N * 2)),
    ("compiled", True, (N * 2 + MASK, N * 2)), ("compiled_iota", True, (N * 2, N * 2)),
    ("fused_v1", True, (VIS * 2, N * 2)), ("fused_v1", False, (N * 2, N * 2)),
])
def test_forward_model(provider, causal, expected):
    assert bs.modeled_traffic(provider, SHAPE, torch.float16, causal) == expected


@pytest.mark.parametrize("provider,causal,expected", [
    ("eager", True, (4 * N * 2 + MASK, 3 * N * 2)), ("eager", False, (3 * N * 2, 2 * N * 2)),
    ("compiled", True, (2 * N * 2, N * 2)), ("fused", True, (2 * VIS * 2, N * 2)), ("fused", False, (2 * N * 2, N * 2)),
])
def test_backward_model(provider, causal, expected):
    assert bs.modeled_backward_traffic(provider, SHAPE, torch.float16, causal) == expected


def test_unknown_providers_are_rejected():
    with pytest.raises(ValueError, match=r"provider must be one of \('eager', 'compiled', 'fused'\), got 'fused_v1'"):
        bs.modeled_backward_traffic("fused_v1", SHAPE, torch.float16, True)


def _csv(rows: list[tuple[str, str, float]]) -> str:
    lines = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
    lines += [f'"{i}","k{i}","{m}","byte","{v:,.0f}"' for i, m, v in rows]
    return "==PROF== noise\n" + "\n".join(lines) + "\n"


def test_measure_sums_kernels_and_counts_l2_writes(monkeypatch):
    calls = []

    def run(cmd, capture_output, text):
        calls.append(cmd)
        out = _csv([("0", "dram__bytes_read.sum", 1000), ("0", "dram__bytes_write.sum", 500),
                    ("0", fb.L2_WRITE_METRIC, 40), ("1", "dram__bytes_read.sum", 3000),
                    ("1", "dram__bytes_write.sum", 2000), ("1", fb.L2_WRITE_METRIC, 100)])
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(fb.subprocess, "run", run)
    m = fb.measure("fused", (1, 2, 8, 8), "float16", True, backward=True)
    assert m == dict(dram_read=4000, dram_write=2500, l2_write=32 * 140, kernels=2)
    assert len(calls) == 1 and "--backward" in calls[0] and "--causal" in calls[0]


def test_measure_falls_back_to_dram_metrics(monkeypatch):
    def run(cmd, capture_output, text):
        if fb.L2_WRITE_METRIC in ",".join(cmd):
            return subprocess.CompletedProcess(cmd, 1, "", "==ERROR== Failed to find metric")
        return subprocess.CompletedProcess(cmd, 0, _csv([("0", "dram__bytes_read.sum", 7),
                                                         ("0", "dram__bytes_write.sum", 5)]), "")

    monkeypatch.setattr(fb.subprocess, "run", run)
    assert fb.measure("eager", (1, 2, 8, 8), "float16", False) == dict(dram_read=7, dram_write=5, l2_write=None,
                                                                       kernels=1)


def test_measure_fails_when_ncu_fails(monkeypatch):
    monkeypatch.setattr(fb.subprocess, "run", lambda cmd, capture_output, text: subprocess.CompletedProcess(
        cmd, 1, "", "no GPU"))
    with pytest.raises(RuntimeError, match=r"ncu must profile eager, got rc 1: no GPU"):
        fb.measure("eager", (1, 2, 8, 8), "float16", False)


def test_table_totals_count_writes_left_in_l2(monkeypatch, capsys):
    monkeypatch.setattr(fb.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fb.torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(fb.shutil, "which", lambda name: "/usr/bin/ncu")
    modeled = dict(zip(("read", "write"), bs.modeled_traffic("fused_v1", (8, 12, 1024, 1024), torch.float16, True)))
    monkeypatch.setattr(fb, "measure", lambda provider, shape, dtype, causal, backward, op: dict(
        dram_read=modeled["read"], dram_write=modeled["write"] - 24_000_000, l2_write=modeled["write"], kernels=1))
    assert fb.main([]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("True    fused_v1"))
    assert line.split()[2:] == ["1", "302.1", "100.8", "177.3", "201.3", "24.0", "302.1", "1.00"]


def test_the_softmax_cases_are_causal_then_full():
    cases = bs.bytes_cases(backward=False)
    assert cases[0] == (True, "eager") and cases[-1] == (False, "fused_v1") and (False, "compiled_iota") not in cases
    assert bs.bytes_model("fused", SHAPE, torch.float16, True, True) == (2 * VIS * 2, N * 2)
