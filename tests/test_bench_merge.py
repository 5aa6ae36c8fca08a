"""bench.merge: the parts of one quick run (softmax, GPT-2 per batch) stored as one file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.merge import main, merge

DATA = Path(__file__).parent / "data"


def _part(tmp_path: Path, name: str, src: str, commit: str = "abc1234") -> Path:
    data = json.loads((DATA / src).read_text())
    data["commit_info"]["id"] = commit
    data["machine_info"].setdefault("fused_attn", {})["gpu_name"] = "NVIDIA H200"
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return p


def test_merge_concatenates_parts_in_order(tmp_path):
    a, b = _part(tmp_path, "a.json", "bench_softmax_small.json"), _part(tmp_path, "b.json", "bench_gpt2_small.json")
    out = tmp_path / "0003_abc1234_quick.json"
    assert main([str(out), str(a), str(b)]) == 0
    merged = json.loads(out.read_text())
    na, nb = (len(json.loads(p.read_text())["benchmarks"]) for p in (a, b))
    assert [x["fullname"] for x in merged["benchmarks"]] == [x["fullname"] for p in (a, b)
                                                             for x in json.loads(p.read_text())["benchmarks"]]
    assert [m["benchmarks"] for m in merged["merged_from"]] == [na, nb]
    assert merged["commit_info"]["id"] == "abc1234"


def test_merge_refuses_other_commits_and_duplicates(tmp_path):
    a = _part(tmp_path, "a.json", "bench_softmax_small.json")
    b = _part(tmp_path, "b.json", "bench_gpt2_small.json", commit="fff0000")
    with pytest.raises(ValueError, match=r"b.json must have commit and GPU \('abc1234', 'NVIDIA H200'\), got "
                                         r"\('fff0000', 'NVIDIA H200'\)"):
        merge([a, b])
    with pytest.raises(ValueError, match="is already in an earlier part"):
        merge([a, a])
