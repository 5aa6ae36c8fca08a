"""`pytest bench` on a GPU without --full runs the headline cases only (bench/conftest.py HEADLINE): the
headline case of every op, ours beside every peer, and GPT-2 at batch 1 and 16; --full runs every case.
Collected here as on a GPU (collection builds no tensor), with torch.cuda reporting an H200."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark")

ROOT = Path(__file__).resolve().parent.parent
COLLECT = """import sys, torch
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda *a: "NVIDIA H200"
import pytest
sys.exit(pytest.main(["bench", "--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


def collected(*args: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", COLLECT, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return [ln for ln in r.stdout.splitlines() if "::" in ln]


def test_the_default_is_the_headline_set_and_full_is_every_case():
    headline, full = collected(), collected("--full")
    assert set(headline) < set(full) and len(headline) <= 90, len(headline)
    functions = {re.search(r"::(\w+)\[", c)[1] for c in full}
    assert functions == {re.search(r"::(\w+)\[", c)[1] for c in headline}  # every benchmark function has some
    for op in ("scaled_masked_softmax", "attention", "decode_attention", "layer_norm", "linear", "mlp",
               "qkv_decode_attention", "sample"):
        ours = [c for c in headline if f"::bench_{op}[" in c]
        assert any(re.search(r"\[fused", c) for c in ours) and any(not re.search(r"\[fused", c) for c in ours), op
    gpt2 = {re.search(r"\[(.*)\]", c)[1] for c in headline if "::bench_gpt2[" in c}
    assert gpt2 == {f"{b}-b{n}-p128-float16" for b in ("graph-fused", "compile-graph", "hf-eager", "hf-sdpa", "hf-fused")
                    for n in (1, 16)}


def test_headline_cases_carry_their_marker():
    assert collected("--full", "-m", "headline") == collected()
