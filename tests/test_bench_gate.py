"""bench.gate: the GPU workflow's regression gate (CPU only, on small saved runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gate
from bench.gate import main

DATA = Path(__file__).parent / "data"


def _run(tmp_path: Path, name: str, slower: dict[str, float], datetime: str = "2026-11-23T00:00:00") -> Path:
    """Softmax + GPT-2 small runs as one file, each case's median times slower[provider or backend]."""
    soft, gpt2 = (json.loads((DATA / f).read_text()) for f in ("bench_softmax_small.json", "bench_gpt2_small.json"))
    soft["benchmarks"] += gpt2["benchmarks"]
    soft["datetime"] = datetime
    for b in soft["benchmarks"]:
        e = b["extra_info"]
        b["stats"]["median"] *= slower.get(e.get("provider") or e.get("backend"), 1.0)
    p = tmp_path / name
    p.write_text(json.dumps(soft))
    return p


def test_gate_passes_an_unchanged_run_and_fails_a_device_regression(tmp_path, capsys):
    base = _run(tmp_path, "base.json", {}, "2026-11-22T00:00:00")
    assert main([str(_run(tmp_path, "same.json", {"fused_v1": 1.09})), "--baseline", str(base)]) == 0
    assert main([str(_run(tmp_path, "slow.json", {"fused_v1": 1.12})), "--baseline", str(base)]) == 1
    out = capsys.readouterr().out
    assert "+12.0% (limit 10%) bench/bench_softmax.py::bench_scaled_masked_softmax[fused_v1-" in out
    assert "graph" not in out.split("regressed")[1]


def test_host_bound_backends_have_their_own_threshold(tmp_path, capsys):
    base = _run(tmp_path, "base.json", {}, "2026-11-22T00:00:00")
    noisy = _run(tmp_path, "noisy.json", {"hf-eager": 1.3, "hf-fused": 1.4, "hf-sdpa": 1.45})
    assert main([str(noisy), "--baseline", str(base)]) == 0
    assert main([str(_run(tmp_path, "2x.json", {"hf-fused": 2.0})), "--baseline", str(base)]) == 1
    assert "(limit 50%) bench/bench_gpt2.py::bench_gpt2[hf-fused-" in capsys.readouterr().out
    assert main([str(_run(tmp_path, "graph.json", {"graph": 1.2})), "--baseline", str(base)]) == 1


def test_baseline_is_the_newest_other_run_on_the_same_gpu(tmp_path, capsys):
    store = tmp_path / "results" / "NVIDIA-H200" / "machine"
    store.mkdir(parents=True)
    _run(store, "0001_old.json", {"fused_v1": 0.5}, "2026-11-21T00:00:00")  # would fail the new run
    _run(store, "0002_last.json", {}, "2026-11-22T00:00:00")
    new = _run(tmp_path, "new.json", {"fused_v1": 1.05})
    _run(store, "0003_new_autosaved.json", {"fused_v1": 1.05}, "2026-11-23T00:00:00")  # new's own copy
    assert main([str(new), "--storage", str(tmp_path / "results")]) == 0
    assert "0002_last.json" in capsys.readouterr().out


def test_each_case_against_the_newest_run_that_has_it(tmp_path, capsys):
    """Stored runs may hold part of the suite: a newer GPT-2-only run does not hide the softmax cases
    of an older full run, and a case is held to the newest run that measured it."""
    store = tmp_path / "results" / "NVIDIA-H200" / "machine"
    store.mkdir(parents=True)
    _run(store, "0001_full.json", {}, "2026-11-21T00:00:00")
    gpt2_only = json.loads(_run(tmp_path, "tmp.json", {"graph": 0.5}).read_text())
    gpt2_only["benchmarks"] = [b for b in gpt2_only["benchmarks"] if "bench_gpt2" in b["fullname"]]
    gpt2_only["datetime"] = "2026-11-22T00:00:00"
    (store / "0002_gpt2.json").write_text(json.dumps(gpt2_only))
    assert main([str(_run(tmp_path, "slow_softmax.json", {"fused_v1": 1.2})), "--storage", str(tmp_path / "results")]) == 1
    out = capsys.readouterr().out
    assert "0001_full.json" in out and "0002_gpt2.json" in out and "bench_scaled_masked_softmax[fused_v1-" in out
    # graph was 2x faster in the newer GPT-2 run: the unchanged full-suite speed is now a regression
    assert main([str(_run(tmp_path, "same.json", {})), "--storage", str(tmp_path / "results")]) == 1
    assert "bench_gpt2[graph-" in capsys.readouterr().out


def test_new_cases_are_listed_not_gated(tmp_path, capsys):
    base = _run(tmp_path, "base.json", {}, "2026-11-22T00:00:00")
    data = json.loads(base.read_text())
    data["benchmarks"] = data["benchmarks"][:3]
    base.write_text(json.dumps(data))
    assert main([str(_run(tmp_path, "new.json", {"fused_v1": 3.0})), "--baseline", str(base)]) == 0
    assert "3 cases compared, 18 new, 0 regressed" in capsys.readouterr().out


def test_gate_rejects_a_file_that_is_not_a_benchmark_run(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main([str(bad)])
    assert exc.value.code == 2 and "bad.json must be a pytest-benchmark JSON file" in capsys.readouterr().err


def test_cases_on_the_host_clock_are_host_bound():
    host = {"extra_info": {"op": "layer_norm", "clock": "host clock around back-to-back calls, no sync inside a round"}}
    device = {"extra_info": {"op": "layer_norm", "p50_us": 4.6}}
    assert gate.is_host_bound(host) and gate.is_host_bound({"extra_info": {"backend": "hf-eager"}})
    assert not gate.is_host_bound(device) and not gate.is_host_bound({"extra_info": {"backend": "graph-fused"}})

