"""FUSED_ATTN_REQUIRE_GPU=1 turns "no GPU" skips into failures (conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def run_gpu_tests(require: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FUSED_ATTN_REQUIRE_GPU"}
    if require:
        env["FUSED_ATTN_REQUIRE_GPU"] = "1"
    # a gpu-marked parametrization and a test using the `cuda` fixture's path (test_empty[...-cuda])
    cmd = [sys.executable, "-m", "pytest", "tests/test_softmax.py", "-q", "-rs", "-p", "no:cacheprovider",
           "-k", "test_empty and cuda or test_mixed_devices_raise_gpu"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens on a machine without a GPU")
def test_require_gpu_turns_skips_into_failures():
    skipped = run_gpu_tests(require=False)
    assert skipped.returncode == 0 and " skipped" in skipped.stdout and "failed" not in skipped.stdout, skipped.stdout
    failed = run_gpu_tests(require=True)
    assert failed.returncode == 1, failed.stdout
    assert "FUSED_ATTN_REQUIRE_GPU=1" in failed.stdout and " passed" not in failed.stdout, failed.stdout
