"""Where benchmark runs are stored: bench/results/<GPU model>/ holds the run JSONs themselves (no
per-Python folder), so `--benchmark-compare` finds them from any Python version; without a GPU the
benchmark command says that it is the CPU smoke mode and stores nothing under bench/results/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from pytest_benchmark.storage.file import FileStorage  # noqa: E402

from bench import conftest as bench_conftest  # noqa: E402
from bench import gate  # noqa: E402
from bench.report import load_run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
GPU_FOLDERS = sorted(p for p in RESULTS.iterdir() if p.is_dir())


class _Logger:
    def warning(self, text, **kw):
        raise AssertionError(text)

    info = debug = warning


def test_stored_runs_sit_directly_in_their_gpu_folder():
    assert GPU_FOLDERS
    for folder in GPU_FOLDERS:
        assert not list(folder.glob("*/*.json")), f"{folder} must hold its runs directly, not in subfolders"
        runs = sorted(folder.glob("[0-9][0-9][0-9][0-9]_*.json"))
        assert runs, folder
        gpu = load_run(runs[-1])["machine_info"]["fused_attn"]["gpu_name"]
        assert bench_conftest.slug(gpu) == folder.name


@pytest.mark.parametrize("python", ["3.11", "3.12", "3.13"])
def test_compare_finds_the_stored_run_from_any_python(python):
    """What --benchmark-compare does: load the newest numbered run of the storage folder, with
    pytest-benchmark's machine id (which names the Python version) as the default subfolder."""
    for folder in GPU_FOLDERS:
        storage = FileStorage(folder, _Logger(), default_machine_id=f"Linux-CPython-{python}-64bit")
        found = [str(path) for path, _ in storage.load()]  # relative to the storage folder
        assert found == sorted(p.name for p in folder.glob("[0-9][0-9][0-9][0-9]_*.json")), (python, found)


def test_gpu_runs_are_stored_under_the_gpu_model(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    config = SimpleNamespace(option=SimpleNamespace(benchmark_storage="file://./.benchmarks"))
    bench_conftest.pytest_configure(config)
    assert config.option.benchmark_storage == f"file://{RESULTS / 'NVIDIA-H200'}"
    bs = SimpleNamespace(storage=SimpleNamespace(default_machine_id="Linux-CPython-3.11-64bit"))
    config._benchmarksession = bs
    bench_conftest.pytest_sessionstart(SimpleNamespace(config=config))
    assert bs.storage.default_machine_id is None  # saved runs go into the GPU folder itself


def test_the_gate_finds_the_stored_baseline():
    """Every case of every stored run is in the gate's baseline, from the newest run that holds it."""
    for folder in GPU_FOLDERS:
        stored = sorted(folder.glob("[0-9][0-9][0-9][0-9]_*.json"))
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
    earlier.write_bytes(sorted(GPU_FOLDERS[0].glob("0*.json"))[-1].read_bytes())
    env = dict(os.environ, TMPDIR=str(tmp_path))
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
