"""Where benchmark runs are stored: bench/results/<GPU model>/ holds one JSON per suite part
(<date>_<commit>_<part>.json, no per-Python folder), `--benchmark-compare` compares each case with its
newest stored measurement without printing machine_info whole; without a GPU the benchmark command says
that it is the CPU smoke mode and stores nothing under bench/results/."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from bench import conftest as bench_conftest  # noqa: E402
from bench import gate, history  # noqa: E402
from bench.report import load_run  # noqa: E402
from tests.child_env import child_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
GPU_FOLDERS = sorted(p for p in RESULTS.iterdir() if p.is_dir())


class _Logger:
    def __init__(self):
        self.lines = []

    def warning(self, text, **kw):
        self.lines.append(("warning", text))

    def info(self, text, **kw):
        self.lines.append(("info", text))


NAME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{4}_[0-9a-f]{7}_[a-z0-9_]+\.json")


def test_stored_runs_sit_directly_in_their_gpu_folder():
    assert GPU_FOLDERS
    for folder in GPU_FOLDERS:
        assert not list(folder.glob("*/*.json")), f"{folder} must hold its runs directly, not in subfolders"
        runs = sorted(folder.glob("*.json"))
        assert runs, folder
        for path in runs:
            assert NAME.fullmatch(path.name), path.name
            run = load_run(path)
            assert bench_conftest.slug(run["machine_info"]["fused_attn"]["gpu_name"]) == folder.name
            assert {history.part_name(b) for b in run["benchmarks"]} == {path.stem.split("_", 2)[2]}, path.name
            assert path.stem.split("_")[1] == run["commit_info"]["id"][:7], path.name


def test_stored_results_stay_small_and_every_stored_run_is_in_the_history():
    # 4 MB: every suite part's newest run on two GPUs and history.csv.gz (0.26 MB, 2.2 MB of CSV text, on
    # 2026-11-30; a serving run adds ~0.2 MB of text, ~0.03 MB gzipped; each run's note once, in history.notes.csv);
    # the largest run is the decode serving selection, eager and in CUDA graphs (4 JSONs, 864 cases, 1.4 MB), the
    # bar's same-run comparison, stored whole. 2.8 MB in all on 2026-11-30.
    size = sum(p.stat().st_size for p in RESULTS.rglob("*") if p.is_file())
    assert size <= 4_000_000, f"bench/results must hold at most 4 MB, got {size / 1e6:.2f} MB"
    have = {(r["source"], r["run"]) for r in history.read_table(RESULTS / history.TABLE)[1]}
    for folder in GPU_FOLDERS:
        for path in folder.glob("*.json"):
            run = load_run(path)
            assert (run["stored_from"], run["datetime"]) in have, path.name


def test_the_stored_history_is_the_gzipped_table():
    assert history.TABLE == "history.csv.gz" and not (RESULTS / "history.csv").exists()
    text = gzip.decompress((RESULTS / history.TABLE).read_bytes()).decode()
    assert text.startswith("commit,gpu,run,source,op,case,provider,")
    assert history.notes_path(RESULTS / history.TABLE) == RESULTS / "history.notes.csv"


def test_storing_into_an_older_checkout_moves_its_plain_table_into_the_gzipped_one(tmp_path, capsys):
    run = load_run(sorted(GPU_FOLDERS[0].glob("*.json"))[-1]) | {"stored_from": "new.json"}
    f = tmp_path / "run.json"
    f.write_text(json.dumps({k: v for k, v in run.items() if k != "_path"}))
    results = tmp_path / "results"
    results.mkdir()
    plain = results / "history.csv"
    plain.write_text("commit,gpu,run,source,op,case,provider,p50_us\n"
                     "abc1234,NVIDIA H200,t1,old.json,softmax,s1,fused,1.5\n")
    (results / "history.notes.csv").write_text("source,run,note\nold.json,t1,the older run\n")
    assert history.main(["store", str(f), "--results", str(results), "--note", "the new run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"{plain}: its rows moved into history.csv.gz, the plain table removed",
                       f"{results / 'history.csv.gz'}: {len(run['benchmarks'])} rows added; wrote 1 files, deleted 0"]
    assert sorted(p.name for p in results.iterdir() if p.is_file()) == ["history.csv.gz", "history.notes.csv"]
    rows = history.read_table(results / "history.csv.gz")[1]
    assert [r["source"] for r in rows] == ["old.json"] + ["new.json"] * len(run["benchmarks"])
    assert history.read_notes(results / "history.csv.gz") == {("old.json", "t1"): "the older run",
                                                             ("new.json", run["datetime"]): "the new run"}


def test_stored_machine_info_is_what_a_comparison_must_match():
    """No host name, CPU clock or commit in machine_info: pytest-benchmark warns with both dicts whole
    whenever they differ, and those differ from run to run."""
    for folder in GPU_FOLDERS:
        for path in folder.glob("*.json"):
            mi = load_run(path)["machine_info"]
            assert history.stable_machine_info(mi) == mi, path.name
            assert "commit" not in mi["fused_attn"] and "node" not in mi and "cpu" not in mi


def test_compare_takes_each_case_from_its_newest_stored_run():
    mi = load_run(sorted(GPU_FOLDERS[0].glob("*.json"))[-1])["machine_info"]
    for folder in GPU_FOLDERS:
        logger = _Logger()
        mapping = bench_conftest.newest_per_case(folder, mi if folder == GPU_FOLDERS[0] else {}, logger)
        gpu = load_run(next(folder.glob("*.json")))["machine_info"]
        base, _ = gate.per_case_baseline({"datetime": "later", "machine_info": gpu}, folder)
        cases = [name for m in mapping.values() for name in m]
        assert len(cases) == len(set(cases)) == len(base["benchmarks"])  # each case compared once
        for path, m in mapping.items():
            for name, b in m.items():
                stored = next(x for x in base["benchmarks"] if x["fullname"] == name)
                assert b["stats"]["median"] == stored["stats"]["median"]
        warnings = [text for kind, text in logger.lines if kind == "warning"]
        assert all(len(w) < 200 for w in warnings), warnings  # one short line per differing key
        if folder == GPU_FOLDERS[0]:
            assert not warnings


def test_a_stored_run_splits_by_part_and_an_older_part_is_pruned(tmp_path):
    run = load_run(sorted(GPU_FOLDERS[0].glob("*.json"))[-1])
    gpu = run["machine_info"]["fused_attn"]["gpu_name"]
    old = run | {"datetime": "2026-01-01T00:00:00+00:00", "stored_from": "old.json"}
    new = run | {"datetime": "2026-02-01T10:30:00+00:00", "stored_from": "new.json"}
    files = []
    for i, r in enumerate((old, new)):
        f = tmp_path / f"run{i}.json"
        f.write_text(json.dumps({k: v for k, v in r.items() if k != "_path"}))
        files.append(f)
    added, written, gone = history.store(files[:1], tmp_path / "results", "")
    assert added == len(run["benchmarks"]) and len(written) == 1 and not gone
    added, written, gone = history.store(files[1:], tmp_path / "results", "")
    folder = tmp_path / "results" / history.gpu_folder(gpu)
    part = history.part_name(run["benchmarks"][0])
    assert [p.name for p in folder.iterdir()] == [f"2026-02-01T1030_{run['commit_info']['id'][:7]}_{part}.json"]
    assert [p.name for p in gone] == [f"2026-01-01T0000_{run['commit_info']['id'][:7]}_{part}.json"]
    assert all("data" not in b["stats"] for b in load_run(folder.iterdir().__next__())["benchmarks"])


def test_gpu_runs_are_stored_under_the_gpu_model(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    config = SimpleNamespace(option=SimpleNamespace(benchmark_storage="file://./.benchmarks", benchmark_compare=True),
                             addinivalue_line=lambda *a: None)
    bench_conftest.pytest_configure(config)
    assert config.option.benchmark_storage == f"file://{RESULTS / 'NVIDIA-H200'}"
    # a bare --benchmark-compare is ours: each case against its newest stored run (newest_per_case), not
    # pytest-benchmark's newest file whole
    assert config.option.benchmark_compare is False and config._fused_attn_compare
    mi = load_run(sorted((RESULTS / "NVIDIA-H200").glob("*.json"))[-1])["machine_info"]
    bs = SimpleNamespace(storage=SimpleNamespace(default_machine_id="Linux-CPython-3.11-64bit"),
                         get_machine_info=lambda: mi, logger=_Logger())
    config._benchmarksession = bs
    bench_conftest.pytest_sessionstart(SimpleNamespace(config=config))
    assert bs.storage.default_machine_id is None  # saved runs go into the GPU folder itself
    stored = {b["fullname"] for p in (RESULTS / "NVIDIA-H200").glob("*.json") for b in load_run(p)["benchmarks"]}
    assert {name for m in bs.compared_mapping.values() for name in m} == stored


def test_the_gate_finds_the_stored_baseline():
    """Every case of every stored run is in the gate's baseline, from the newest run that holds it."""
    for folder in GPU_FOLDERS:
        stored = sorted(folder.glob("*.json"))  # a date first: in time order
        newest = stored[-1]
        run = load_run(newest)
        base, used = gate.per_case_baseline(run | {"datetime": "later"}, RESULTS)
        assert newest in used
        names = {b["fullname"] for b in base["benchmarks"]}
        for path in stored:
            assert {b["fullname"] for b in load_run(path)["benchmarks"]} <= names, path


@pytest.mark.skipif(torch.cuda.is_available(), reason="what the benchmark command does without a GPU")
def test_the_benchmark_command_without_a_gpu_says_so_and_saves_or_compares_nothing(tmp_path):
    status = ["git", "status", "--porcelain", "--untracked-files=all"]
    before = subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout
    cpu_storage = tmp_path / "fused_attn_bench_cpu"
    cpu_storage.mkdir()  # an earlier CPU run there, from another commit: must not be compared with
    earlier = cpu_storage / "0001_earlier.json"
    earlier.write_bytes(sorted(GPU_FOLDERS[0].glob("*.json"))[-1].read_bytes())
    env = child_env(TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "pytest", "bench", "-p", "no:cacheprovider", "-k",
                        "softmax and eager and causal and not backward", "--benchmark-autosave",
                        "--benchmark-compare"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    line = ("fused_attn bench: no CUDA GPU: the benchmarks need one. This run is the CPU smoke mode, which only "
            "checks that the harness and every case run (CI uses it); its timings are not comparable with anything. "
            "Nothing is saved or compared (--benchmark-autosave, --benchmark-compare ignored without a GPU).")
    lines = r.stdout.strip().splitlines()
    assert lines.count(line) == 2 and lines[-2] == line, r.stdout  # in the header and above pytest's summary
    assert "Comparing against" not in r.stdout and "Saved benchmark" not in r.stdout + r.stderr
    assert list(cpu_storage.iterdir()) == [earlier]
    assert subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout == before


def test_an_older_file_with_a_case_no_newer_run_measured_stays(tmp_path):
    """A newer run of some of a part's cases (the long-context decode shapes, say) leaves the older file
    that holds the others; a file whose every case a newer run holds goes."""
    run = load_run(sorted(GPU_FOLDERS[0].glob("*.json"))[-1])
    assert len(run["benchmarks"]) >= 2
    gpu = run["machine_info"]["fused_attn"]["gpu_name"]
    full = run | {"datetime": "2026-01-01T00:00:00+00:00", "stored_from": "full.json"}
    some = run | {"datetime": "2026-02-01T10:30:00+00:00", "stored_from": "some.json",
                  "benchmarks": run["benchmarks"][:1]}
    files = []
    for i, r in enumerate((full, some)):
        f = tmp_path / f"run{i}.json"
        f.write_text(json.dumps({k: v for k, v in r.items() if k != "_path"}))
        files.append(f)
    history.store(files[:1], tmp_path / "results", "")
    _, _, gone = history.store(files[1:], tmp_path / "results", "")
    folder = tmp_path / "results" / history.gpu_folder(gpu)
    assert not gone and len(list(folder.iterdir())) == 2
    everything = run | {"datetime": "2026-03-01T10:30:00+00:00", "stored_from": "all.json"}
    f = tmp_path / "run2.json"
    f.write_text(json.dumps({k: v for k, v in everything.items() if k != "_path"}))
    _, _, gone = history.store([f], tmp_path / "results", "")
    assert len(gone) == 2 and len(list(folder.iterdir())) == 1
