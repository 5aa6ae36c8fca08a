"""bench/trace_gpt2_step.py: the summary of the persistent step's stage trace, and its mark names against the
kernel's marks (CPU only)."""

import statistics
from pathlib import Path

import pytest
import torch

from bench import trace_gpt2_step as t

KERNEL = Path(__file__).resolve().parents[1] / "csrc" / "gpt2_decode_step" / "gpt2_decode_step_kernel.cuh"


def _run_body() -> str:
    src = KERNEL.read_text()
    return src[src.index("__device__ void run() {"):src.index("}  // namespace step")]


def test_mark_names_follow_the_kernel():
    """Per layer: run()'s marks in the layer loop plus gemv's two per stage; the head likewise."""
    body = _run_body()
    loop, head = body.split("// ln_f -> lm_head.")
    loop = loop[loop.index("for (int l = 0; l < L; ++l) {"):]
    per_layer = loop.count("mark();") + 2 * loop.count("gemv(")
    per_head = head.count("mark();") + 2 * head.count("gemv(")
    assert per_layer == len(t.LAYER)
    assert per_head == len(t.HEAD)
    assert body[:body.index("for (int l")].count("mark();") == 1  # the start
    assert len(t.mark_names(12)) <= t.MARKS
    assert "FUSED_ATTN_STEP_TRACE" in KERNEL.read_text()


def test_summarize_reads_intervals_and_spread():
    names = t.mark_names(3)
    steps, blocks, n = 2, 4, len(names)
    gaps = torch.arange(1, n, dtype=torch.float64) * 1000.0  # interval i lasts (i + 1) us on every block
    ns = torch.zeros(steps, blocks, n, dtype=torch.float64)
    ns[..., 1:] = gaps.cumsum(0)
    ns[:, 3, 1:] += 500.0  # block 3 is 0.5 us late at every mark after the start
    s = t.summarize(ns.long(), names)
    assert s["step_us"] == pytest.approx(gaps.sum().item() / 1e3, abs=1e-9)  # the median block
    # layers 1 and 2's first interval (proj.done -> arrive.qkv) ends at marks L1.arrive.qkv and L2.arrive.qkv
    first = 1 + len(t.LAYER)  # L1.arrive.qkv
    key = " 0 proj.done -> arrive.qkv"
    want = statistics.median([first, first + len(t.LAYER)])  # interval ending at mark m lasts m us
    assert s["per_layer"][key][0] == pytest.approx(want, abs=1e-9)
    assert len(s["per_layer"]) == len(t.LAYER)
    assert s["single"][0][0] == "start -> L0.arrive.qkv"
    assert s["single"][0][2] == pytest.approx(1.5)  # the late block's first interval: 1 + 0.5
    assert all(v == pytest.approx(0.5) for v in s["spread"].values())
    assert len(s["spread"]) == 3 * 5 + 1


def test_summarize_refuses_a_wrong_mark_count():
    with pytest.raises(ValueError, match=r"ns must have \d+ marks in its last dim, got 3"):
        t.summarize(torch.zeros(1, 2, 3, dtype=torch.long), t.mark_names(2))
