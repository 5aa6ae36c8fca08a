"""Shared pytest setup: hypothesis profiles and device fixtures.

Profiles (select with HYPOTHESIS_PROFILE, default `dev`, or `ci` when CI=true):
  dev      fast local iteration
  ci       CPU machine, deterministic (derandomized), small
  gpu      a real GPU: no deadline, >= 500 examples per property
  nightly  >= 5000 examples per property
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=40, **_common)
settings.register_profile("ci", max_examples=30, derandomize=True, print_blob=True, **_common)
settings.register_profile("gpu", max_examples=500, print_blob=True, **_common)
settings.register_profile("nightly", max_examples=5000, print_blob=True, **_common)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI", "").lower() == "true" else "dev")
)

HAS_CUDA = torch.cuda.is_available()
NO_CUDA_REASON = "needs a CUDA GPU (torch.cuda.is_available() is False on this machine)"
# FUSED_ATTN_REQUIRE_GPU=1 (the GPU workflow, bench/run_gpu.sh): a GPU test that cannot run fails
# instead of skipping, so a broken driver or a CPU-only torch cannot turn the GPU suite green.
REQUIRE_GPU = os.environ.get("FUSED_ATTN_REQUIRE_GPU", "") == "1"


def skip_or_fail(reason: str) -> None:
    if REQUIRE_GPU:
        pytest.fail(f"{reason}, and FUSED_ATTN_REQUIRE_GPU=1", pytrace=False)
    pytest.skip(reason)


def _has_nvcc() -> bool:
    from fused_attn import build

    try:
        build.find_cuda_home()
    except build.BuildError:
        return False
    return True


HAS_NVCC = _has_nvcc()
NO_NVCC_REASON = "needs the CUDA toolkit (nvcc) to build fused_attn's library"


def pytest_configure(config):
    # A custom op without an autograd kernel makes PyTorch warn and drop the gradient:
    # anywhere in the suite that is a failure, not a warning.
    config.addinivalue_line("filterwarnings", "error:.*an autograd kernel was not registered")


def pytest_runtest_setup(item):
    if "gpu" in item.keywords and not HAS_CUDA:
        skip_or_fail(NO_CUDA_REASON)


@pytest.fixture
def cuda():
    if not HAS_CUDA:
        skip_or_fail(NO_CUDA_REASON)
    return torch.device("cuda")


@pytest.fixture
def built_library(cuda):
    """The compiled CUDA library loaded into this process, for GPU tests that call torch.ops.fused_attn
    directly and mean its C++ kernels. Nothing else needs it: the ops' CPU and fake kernels are
    registered at import, and a CPU-only test run builds nothing (CI compiles on purpose, with
    `python -m fused_attn.build`)."""
    if not HAS_NVCC:
        skip_or_fail(NO_NVCC_REASON)
    import fused_attn

    fused_attn.load()
    return True


@pytest.fixture(autouse=True)
def _no_cuda_build_without_a_gpu():
    """On a machine without a GPU no test may build or load the CUDA library (~70 s and 30 MB of
    cache on a small machine, for kernels that cannot run): the test that did it fails."""
    from fused_attn import _ops

    loaded_before = _ops.is_loaded()
    yield
    if not HAS_CUDA and not loaded_before and _ops.is_loaded():
        pytest.fail("this test loaded fused_attn's CUDA library on a machine without a GPU: a CPU-only "
                    "test run must build nothing (CPU and meta tensors need no build)", pytrace=False)
