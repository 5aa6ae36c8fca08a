"""The README a newcomer reads first, and the product rules every tracked file keeps: a user's document of
at most 300 lines in a newcomer's order, one spelling of the commands, a results table that is exactly what
``python -m bench.report`` writes from the stored runs, no work-history words anywhere, and only the
environment variables the README lists."""

from __future__ import annotations

import gzip
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BENCH_README = (ROOT / "bench" / "README.md").read_text()
# What shipped code may read: the build's cache, flags and debug build, one kill switch, the length check, and
# the -D the build passes for sm_90a.
ALLOWED_ENV = {"FUSED_ATTN_CACHE", "FUSED_ATTN_NVCC_FLAGS", "FUSED_ATTN_DEBUG", "FUSED_ATTN_PDL",
               "FUSED_ATTN_VALIDATE_LENGTHS", "FUSED_ATTN_SM90A"}
# Built from pieces so that this file does not name what it looks for.
HISTORY_WORDS = re.compile(r"\b[Ss]essions? \d|\b[Ii]ssues? #?\d|\bwork" + " period")


def test_sections_come_in_a_newcomers_order_within_300_lines():
    sections = re.findall(r"^## (.+)$", README, flags=re.M)
    assert sections == ["Requirements", "Install", "The two commands", "API", "GPT-2", "Results", "Developing"]
    assert len(README.splitlines()) <= 300


def test_the_commands_are_spelled_one_way_and_show_skip_reasons():
    assert "python3 " not in README and "python3 " not in BENCH_README
    assert "python -m venv .venv" in README
    assert "python -m pytest tests -rs" in README
    assert "python -m pytest bench --benchmark-autosave --benchmark-compare" in README


def test_the_results_table_is_the_one_bench_report_writes_from_the_stored_runs():
    from bench import report

    block = README.split(report.BEGIN, 1)[1].split(report.END, 1)[0].strip("\n").splitlines()
    want = report.results_table(report.current_rows(report.headline_rows(ROOT / "bench" / "results")))
    assert block == want, "README's results are stale: run `python -m bench.report --readme README.md --charts docs`"


def test_the_charts_the_readme_shows_exist():
    for path in re.findall(r"!\[[^]]*\]\(([^)]+\.png)\)", README):
        assert (ROOT / path).is_file(), path


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"needs a git checkout to list the tracked files, got {e}")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_no_tracked_file_names_a_work_period_or_an_issue_number():
    found = []
    for path in _tracked():
        if path.suffix in (".png",) or not path.is_file():
            continue
        data = path.read_bytes()  # a gzipped file (the history table) is checked as the text it holds
        text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode(errors="replace")
        for m in HISTORY_WORDS.finditer(path.name + "\n" + text):
            line = text.count("\n", 0, max(m.start() - len(path.name) - 1, 0)) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}")
    assert not found, f"{len(found)} places use work-history words:\n" + "\n".join(found[:40])


def test_shipped_code_reads_only_the_environment_variables_the_readme_lists():
    names = set()
    for path in _tracked():
        rel = path.relative_to(ROOT).parts
        if rel[0] in ("fused_attn", "csrc") and path.suffix in (".py", ".h", ".cuh", ".cu", ".cpp"):
            names |= set(re.findall(r"FUSED_ATTN_[A-Z0-9_]+", path.read_text()))
    assert names <= ALLOWED_ENV, sorted(names - ALLOWED_ENV)
    for name in names - {"FUSED_ATTN_SM90A"}:
        assert f"`{name}" in README, f"{name} must be in the README's environment table"


def test_stored_paths_named_in_the_readmes_exist():
    for text in (README, BENCH_README):
        for path in re.findall(r"`(bench/results/[^`<]+\.json)`", text):
            assert (ROOT / path).is_file(), path
