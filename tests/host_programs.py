"""Small C++ programs built with nvcc against csrc/ and run on the host: the tests of header-only pieces whose
logic runs the same there (tests/test_fastdiv.py, tests/test_func_attrs.py, tests/test_decode_heuristics.py).
Skips the calling test where no CUDA toolkit is found (CI has one)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fused_attn import build


def host_binary(folder: Path, name: str, source: str) -> Path:
    """source (a main() that includes headers as "common/...") compiled by nvcc into folder/name."""
    try:
        nvcc = build.find_cuda_home() / "bin" / "nvcc"
    except RuntimeError as e:
        pytest.skip(str(e))
    (folder / f"{name}.cu").write_text(source)
    exe = folder / name
    r = subprocess.run([str(nvcc), "-std=c++17", "-O2", "-I", str(build.CSRC), "-o", str(exe),
                        str(folder / f"{name}.cu")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return exe
