"""The README a newcomer reads first: its order, one spelling of the Python command, the commands it
promises, and no references to issue numbers."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BENCH_README = (ROOT / "bench" / "README.md").read_text()


def test_sections_come_in_a_newcomers_order():
    sections = re.findall(r"^## (.+)$", README, flags=re.M)
    assert sections == ["Requirements", "Install", "The two commands", "API", "GPT-2", "Results", "Developing"]


def test_the_commands_are_spelled_one_way_and_show_skip_reasons():
    assert "python3 " not in README and "python3 " not in BENCH_README
    assert "python -m venv .venv" in README
    assert "python -m pytest tests -rs" in README
    assert "python -m pytest bench --benchmark-autosave --benchmark-compare" in README


def test_results_name_their_commit_and_the_tables_live_in_bench_readme():
    results = README.split("## Results", 1)[1].split("## Developing", 1)[0]
    assert "commit c3412da" in results and "SASS" in results and "NVIDIA H100 80GB HBM3" in results
    assert "| shape" not in README  # the long tables are in bench/README.md
    assert "python -m bench.report bench/results/NVIDIA-H100-80GB-HBM3/" in BENCH_README


def test_no_issue_numbers_and_stored_paths_exist():
    for text in (README, BENCH_README):
        assert not re.search(r"\bissues? \d", text)
        for path in re.findall(r"`(bench/results/[^`<]+\.json)`", text):
            assert (ROOT / path).is_file(), path
