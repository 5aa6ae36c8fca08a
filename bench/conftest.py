"""Benchmark harness: options, GPU machine info, per-GPU storage, device-time measurement.

Every case times with CUDA events around one call per round, after warm-up, with L2
flushed and left clean before each round (a 256 MiB write, then a 256 MiB read, outside the
timed region) and a spin kernel queued ahead of the call, checked every round to outlast the
host's queueing, so host launch overhead never lands between the events.
pytest-benchmark runs in pedantic mode with a clock that advances by the event time of
each round (bench/harness.py), so its statistics and `--benchmark-compare` are device
times; the same times give the p5/p50/p95 in `extra_info`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from bench.harness import DeviceTimer, matmul_peak, measure_ceilings, settle_process
from bench.history import host_info, stable_machine_info

BENCH_DIR = Path(__file__).resolve().parent


def pytest_addoption(parser):
    g = parser.getgroup("fused_attn bench")
    g.addoption("--full", action="store_true",
                help="every case: every dtype, shape and provider (default: the headline cases, HEADLINE)")
    g.addoption("--bench-dtypes", default=None, help="comma list of float32,float16,bfloat16")
    g.addoption("--bench-batches", default=None, help="comma list of batch sizes for the GPT-2 shapes")
    g.addoption("--bench-seqlens", default=None, help="comma list of N for the GPT-2 shapes")
    g.addoption("--bench-rounds", type=int, default=int(os.environ.get("FUSED_ATTN_BENCH_ROUNDS", 60)))
    g.addoption("--bench-warmup", type=int, default=int(os.environ.get("FUSED_ATTN_BENCH_WARMUP", 5)))
    g.addoption("--bench-gpt2-batches", default=None,
                help="comma list of batch sizes for bench_gpt2 (default 1,16; 1,4,16,64 with --full)")
    g.addoption("--bench-gpt2-rounds", type=int, default=5, help="whole generate() calls per GPT-2 case")
    g.addoption("--bench-gpt2-paired-rounds", type=int, default=12,
                help="hf-fused rounds, each after an interleaved hf-sdpa round (their difference is small)")


# The headline cases, what `pytest bench` runs on a GPU without --full (in about 10 minutes on an H200):
# per benchmark function, the case ids (float16, GPT-2's shapes at batch 16 where the op has a batch)
# whose every provider runs: ours beside its peers. --full runs every case. Without a GPU every case of
# the small CPU lists runs (the smoke mode checks that each one runs).
HEADLINE = {
    "bench_scaled_masked_softmax": r".*-8x12x1024x1024-float16-causal",
    "bench_scaled_masked_softmax_backward": r".*-8x12x1024x1024-float16-causal",
    "bench_attention": r".*-b8-hq12-hkv12-d64-s1024-causal-float16",
    "bench_decode_attention": r".*-b16-hq12-hkv12-d64-l1024-float16",
    "bench_qkv_decode_attention": r".*-b1-h12-l1024-float16",  # GPT-2's step runs it at 1-8 rows
    "bench_layer_norm": r"[^-]+-layer_norm-add-w768-m16-float16",
    "bench_embedding_layer_norm": r"[^-]+-embed-w768-m16-float16",
    "bench_linear": r"[^-]+-k768-n2304-m16-float16",
    "bench_mlp": r".*-gpt2-m16-float16",
    "bench_sample": r"[^-]+-r16-v50257-t1-float16",
    "bench_layer": r".*-gpt2-s1024-float16",
    # hf-sdpa / hf-fused: transformers' decode with our attention against SDPA (time between tokens)
    "bench_gpt2": r"(graph-fused|compile-graph|hf-eager|hf-sdpa|hf-fused)-b(1|16)-p128-float16",
    "bench_hf_prefill": r"hf-(eager|sdpa|fused)-b(1|8)-p(128|960)-float16",
    "bench_host": r".*",  # every op's host time beside its PyTorch equivalent (~30 s)
}


def is_headline(function: str, case_id: str) -> bool:
    pattern = HEADLINE.get(function)
    return pattern is not None and re.fullmatch(pattern, case_id) is not None


def pytest_collection_modifyitems(config, items):
    """Mark the headline cases (`-m headline` selects them under --full too); on a GPU without --full, run
    only them."""
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and is_headline(item.originalname, callspec.id):
            item.add_marker(pytest.mark.headline)
            keep.append(item)
        else:
            drop.append(item)
    if torch.cuda.is_available() and not config.getoption("--full") and drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def slug(gpu_name: str) -> str:
    """The folder name of a GPU model: "NVIDIA H100 80GB HBM3" -> "NVIDIA-H100-80GB-HBM3"."""
    return re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-")


def gpu_slug() -> str:
    return slug(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"


NO_GPU = ("no CUDA GPU: the benchmarks need one. This run is the CPU smoke mode, which only checks that the "
          "harness and every case run (CI uses it); its timings are not comparable with anything")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "headline: a headline case (bench/conftest.py HEADLINE), run without --full")
    # Saved runs live in git as bench/results/<GPU model>/NNNN_<commit>_<name>.json, one folder per
    # GPU model and nothing else in the path (pytest-benchmark's own machine id names the Python
    # version), so --benchmark-compare finds the last run on the same kind of GPU from any Python.
    # Without a GPU nothing is saved or compared (CPU smoke timings compare with nothing), and
    # pytest-benchmark's storage points outside the checkout.
    storage = getattr(config.option, "benchmark_storage", None)
    if storage in (None, "file://./.benchmarks"):
        if torch.cuda.is_available():
            folder = BENCH_DIR / "results" / gpu_slug()
        else:
            folder = Path(tempfile.gettempdir()) / "fused_attn_bench_cpu"
        config.option.benchmark_storage = f"file://{folder}"
        config._fused_attn_storage = folder
        if getattr(config.option, "benchmark_compare", None) is True and torch.cuda.is_available():
            # A bare --benchmark-compare: pytest-benchmark would compare with the newest file only, and the
            # stored runs are one file per suite part (bench/results/<GPU>/<date>_<commit>_<part>.json), so
            # each case is compared with its newest stored measurement instead (pytest_sessionstart).
            config.option.benchmark_compare = False
            config._fused_attn_compare = True
    if not torch.cuda.is_available():
        ignored = [flag for flag, dest in (("--benchmark-autosave", "benchmark_autosave"),
                                           ("--benchmark-save", "benchmark_save"),
                                           ("--benchmark-compare", "benchmark_compare"))
                   if getattr(config.option, dest, None)]
        for dest, off in (("benchmark_autosave", False), ("benchmark_save", None), ("benchmark_compare", [])):
            if hasattr(config.option, dest):  # pytest-benchmark's defaults
                setattr(config.option, dest, off)
        config._fused_attn_ignored = ignored


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    # pytest-benchmark loaded the runs to compare with when it was configured (it finds the files
    # directly in the storage folder too); from here on it saves there too, not in a per-Python subfolder.
    bs = getattr(session.config, "_benchmarksession", None)
    if bs is not None and getattr(session.config, "_fused_attn_storage", None) is not None:
        bs.storage.default_machine_id = None
        if getattr(session.config, "_fused_attn_compare", False):
            bs.compared_mapping = newest_per_case(session.config._fused_attn_storage, bs.get_machine_info(), bs.logger)


def newest_per_case(folder: Path, machine_info: dict, logger) -> dict:
    """{stored file: {case: its stored benchmark}}, each case from the newest stored run (by datetime) that
    measured it; one line per file used, and one per machine_info key that differs from this run's."""
    from pytest_benchmark.stats import normalize_stats

    runs = []
    for path in folder.glob("*.json"):
        run = json.loads(path.read_text())
        runs.append((run.get("datetime", ""), path, run))
    seen: set[str] = set()
    mapping = {}
    for _, path, run in sorted(runs, key=lambda r: r[0], reverse=True):
        cases = {}
        for b in run["benchmarks"]:
            if b["fullname"] not in seen:
                normalize_stats(b["stats"])
                cases[b["fullname"]] = b
        if not cases:
            continue
        seen |= set(cases)
        mapping[path] = cases
        logger.info(f"Comparing {len(cases)} cases against {path.name}")
        ours, theirs = stable_machine_info(machine_info), stable_machine_info(run.get("machine_info", {}))
        flat = lambda d: {**{k: v for k, v in d.items() if k != "fused_attn"}, **d.get("fused_attn", {})}  # noqa: E731
        ours, theirs = flat(ours), flat(theirs)
        for key in sorted(set(ours) | set(theirs)):
            if ours.get(key) != theirs.get(key):
                logger.warning(f"{path.name} ran with {key} {theirs.get(key)!r}, this run {ours.get(key)!r}")
    return mapping


def _no_gpu_line(config) -> str:
    ignored = getattr(config, "_fused_attn_ignored", [])
    return (f"fused_attn bench: {NO_GPU}." + (f" Nothing is saved or compared ({', '.join(ignored)} ignored "
                                              "without a GPU)." if ignored else ""))


def pytest_report_header(config):
    if not torch.cuda.is_available():
        return [_no_gpu_line(config)]
    return [f"fused_attn bench: {torch.cuda.get_device_name()}; runs are stored in and compared with "
            f"{getattr(config, '_fused_attn_storage', None) or config.option.benchmark_storage}"]


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's tables: the last thing printed
def pytest_terminal_summary(terminalreporter, config):
    if not torch.cuda.is_available():
        terminalreporter.write_line(_no_gpu_line(config), yellow=True)


def pytest_benchmark_update_commit_info(config, commit_info):
    # pytest-benchmark reads git itself; on the device machine that .git can predate the
    # copied tree, so the commit named by FUSED_ATTN_COMMIT wins and "dirty" is unknown.
    # The host's per-run facts live here too, beside the commit: both change from run to run.
    import platform

    from pytest_benchmark.plugin import get_cpu_info

    commit_info["host"] = host_info({"node": platform.node(), "release": platform.release(), "cpu": get_cpu_info()})
    if os.environ.get("FUSED_ATTN_COMMIT"):
        commit_info.update(id=os.environ["FUSED_ATTN_COMMIT"], dirty=None, source="FUSED_ATTN_COMMIT")


def _driver_version() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def gpu_info() -> dict:
    """What a comparison between runs must match: the GPU, its driver, torch and CUDA (no commit, no host:
    those change from run to run and sit in commit_info)."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu_name=p.name, sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    capability=f"{p.major}.{p.minor}", driver=_driver_version(),
                    l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
    else:
        info.update(gpu_name="none")
    return info


@pytest.hookimpl(tryfirst=True)
def pytest_benchmark_generate_machine_info(config):
    import platform

    return {"system": platform.system(), "machine": platform.machine(),
            "python_implementation": platform.python_implementation(), "python_version": platform.python_version()}


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["fused_attn"] = gpu_info()


@pytest.fixture(scope="session", autouse=True)
def settled_process():
    """Every case measured in the process state users run in, whatever the selection and order
    (harness.settle_process: our programmatic launches are slower in a process past a few stream joins)."""
    settle_process()


@pytest.fixture(scope="session")
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def ceilings_gbps(device):
    """Device bandwidths measured once per session (GB/s, 1e9 B/s): copy (bytes read + written),
    read-only, write-only. Every memory-bound case is compared with them."""
    if device.type != "cuda":
        return None
    return measure_ceilings()


@pytest.fixture(scope="session")
def timer(request, device):
    return DeviceTimer(device, request.config.getoption("--bench-rounds"), request.config.getoption("--bench-warmup"))


@pytest.fixture(scope="session")
def launch_floor_us(timer, device):
    """Device time of an empty kernel under the benchmark's timing (once per session)."""
    return timer.launch_floor_us() if device.type == "cuda" else None


@pytest.fixture(scope="session")
def medians() -> dict:
    """p50 of every case run so far in this session, keyed by (group, provider): the
    speedups in extra_info compare providers measured in the same run."""
    return {}


@pytest.fixture(scope="session")
def matmul_peak_tflops(device):
    """dtype -> the measured dense matmul ceiling in TFLOP/s (measured once per dtype and session);
    None without a GPU."""
    cache: dict = {}

    def peak(dtype: torch.dtype):
        if device.type != "cuda":
            return None
        if dtype not in cache:
            cache[dtype] = matmul_peak(dtype)
        return cache[dtype]

    return peak
