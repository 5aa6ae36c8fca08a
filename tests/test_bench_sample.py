"""The sample benchmark's sample+history groups: the cases, each provider's state after repeated calls and
the history check (CPU; the GPU numbers come from bench/run_gpu.sh's sample step)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pytest_benchmark")

from bench import bench_sample as smp  # noqa: E402
from tests.test_bench_decode import _config  # noqa: E402


def _state(rows: int):
    """(logits, counters, history, index) of a sample+history case on the CPU."""
    logits = torch.randn(rows, 3000, generator=torch.Generator().manual_seed(0))
    history = torch.full((rows, smp.HISTORY_LEN), smp.HISTORY_FILL, dtype=torch.int64)
    return logits, torch.zeros(3, rows, dtype=torch.int32), history, smp.history_columns(rows, "cpu")


def test_gpu_cases_add_the_history_groups():
    cases = [c for c in smp.make_cases(_config(), cuda=True) if c.get("op") == "history"]
    assert {c["shape"] for c in cases} == set(smp.ADVANCE_SHAPES) and len(cases) == 2 * 4
    assert {c["provider"] for c in cases} == set(smp.ADVANCE_PROVIDERS) == set(smp.HISTORY_NOTES)
    assert smp.case_id(cases[-1]) == "history-fused-r16-v50257-t0-float16"
    assert smp.case_id(cases[0]) == "history-eager-r1-v50257-t0-float16"
    # one column per row, all in [0, L): no call writes -1 into out instead of recording its token
    index = smp.history_columns(16, "cpu")
    assert index.unique().numel() == 16 and index.min() >= 0 and index.max() < smp.HISTORY_LEN


@pytest.mark.parametrize("provider", ["eager", "unfused", "fused"])
def test_each_history_provider_leaves_the_same_state_call_after_call(provider):
    logits, counters, history, index = _state(4)
    fn = smp.history_provider_fn(provider, logits, counters, history, index)
    for _ in range(3):
        smp.check(provider, fn(), logits, 0.0)
    smp.check_history(provider, history, index, logits)
    assert torch.equal(counters, torch.full_like(counters, 3))
    assert torch.equal(index, smp.history_columns(4, "cpu"))  # never advanced


def test_the_history_check_rejects_a_missing_or_out_of_range_write():
    logits, counters, history, index = _state(4)
    smp.advance_provider_fn("fused", logits, counters)()  # no history write
    with pytest.raises(AssertionError, match="fused: the history must hold each row's token at its column"):
        smp.check_history("fused", history, index, logits)
    wrong = index.clone()
    wrong[2] = smp.HISTORY_LEN  # out of range: -1 in out, nothing in row 2's history
    out = smp.history_provider_fn("fused", logits, counters, history, wrong)()
    assert out[2] == -1
    with pytest.raises(AssertionError, match="fused: not the argmax"):
        smp.check("fused", out, logits, 0.0)
    with pytest.raises(AssertionError, match="fused: the history must hold"):
        smp.check_history("fused", history, index, logits)
