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

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from bench.harness import DeviceTimer, measure_ceilings

BENCH_DIR = Path(__file__).resolve().parent


def pytest_addoption(parser):
    g = parser.getgroup("fused_attn bench")
    g.addoption("--full", action="store_true", help="full sweep: every dtype and shape (default: quick)")
    g.addoption("--bench-dtypes", default=None, help="comma list of float32,float16,bfloat16")
    g.addoption("--bench-batches", default=None, help="comma list of batch sizes for the GPT-2 shapes")
    g.addoption("--bench-seqlens", default=None, help="comma list of N for the GPT-2 shapes")
    g.addoption("--bench-rounds", type=int, default=int(os.environ.get("FUSED_ATTN_BENCH_ROUNDS", 60)))
    g.addoption("--bench-warmup", type=int, default=int(os.environ.get("FUSED_ATTN_BENCH_WARMUP", 5)))
    g.addoption("--bench-gpt2-rounds", type=int, default=5, help="whole generate() calls per GPT-2 case")
    g.addoption("--bench-gpt2-paired-rounds", type=int, default=12,
                help="hf-fused rounds, each after an interleaved hf-eager round (their difference is small)")


def gpu_slug() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name()).strip("-")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Saved runs live in git under bench/results/<GPU model>/, so --benchmark-compare
    # finds the last run on the same kind of GPU.
    storage = getattr(config.option, "benchmark_storage", None)
    if storage in (None, "file://./.benchmarks"):
        config.option.benchmark_storage = f"file://{BENCH_DIR / 'results' / gpu_slug()}"


def _git_commit() -> str:
    """FUSED_ATTN_COMMIT when set (the device tool copies a working tree whose .git may be
    older than the tree), else git's HEAD."""
    if os.environ.get("FUSED_ATTN_COMMIT"):
        return os.environ["FUSED_ATTN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def pytest_benchmark_update_commit_info(config, commit_info):
    # pytest-benchmark reads git itself; on the device machine that .git can predate the
    # copied tree, so the commit named by FUSED_ATTN_COMMIT wins and "dirty" is unknown.
    if os.environ.get("FUSED_ATTN_COMMIT"):
        commit_info.update(id=os.environ["FUSED_ATTN_COMMIT"], dirty=None, source="FUSED_ATTN_COMMIT")


def _driver_version() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def pytest_benchmark_update_machine_info(config, machine_info):
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "commit": _git_commit()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu_name=p.name, sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    capability=f"{p.major}.{p.minor}", driver=_driver_version(),
                    l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
    else:
        info.update(gpu_name="none")
    machine_info["fused_attn"] = info


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
