"""bench.harness: the per-round flush and spin check, with CUDA events faked (CPU only)."""

from __future__ import annotations

import pytest
import torch

from bench import harness


class FakeEvent:
    """Stands in for torch.cuda.Event: query() answers from a script (True = already done)."""

    script: list[bool] = []

    def __init__(self, enable_timing: bool = False):
        pass

    def record(self):
        pass

    def query(self) -> bool:
        return FakeEvent.script.pop(0)

    def synchronize(self):
        pass

    def elapsed_time(self, other) -> float:
        return 0.005  # ms


@pytest.fixture
def timer(monkeypatch):
    ops = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: ops.append(("spin", cycles)))
    t = harness.DeviceTimer(torch.device("cpu"), rounds=3, warmup=0)
    t.cuda = True
    t.flush_buf = torch.ones(64, dtype=torch.uint8)
    t.sweep_buf = torch.ones(16)
    t._sweep_sum = torch.empty(())
    t._spin_done = FakeEvent()
    t.ops = ops
    return t


def test_flush_zeroes_then_sweeps_then_spins(timer):
    timer.flush()
    assert timer.flush_buf.sum() == 0 and timer._sweep_sum.item() == 16.0
    assert timer.ops == [("spin", harness.SPIN_CYCLES)]


def test_a_round_the_host_fell_behind_in_is_timed_again_with_a_longer_spin(timer):
    FakeEvent.script = [True, False]  # the spin had ended when the call was queued; then it had not
    timer.flush()
    assert timer.time_once(lambda: None) == pytest.approx(5e-6)
    assert timer.spin_cycles == 2 * harness.SPIN_CYCLES
    assert timer.ops == [("spin", harness.SPIN_CYCLES), ("spin", 2 * harness.SPIN_CYCLES)]


def test_a_host_that_never_keeps_up_is_an_error(timer):
    FakeEvent.script = [True] * 10
    timer.flush()
    with pytest.raises(RuntimeError, match=r"the spin kernel must outlast host enqueueing, got the device idle "
                                           rf"before the call was queued even with {harness.MAX_SPIN_CYCLES} cycles"):
        timer.time_once(lambda: None)
