"""Device timing for the benchmarks (imported by bench/conftest.py and the bench modules)."""

from __future__ import annotations

import statistics
import time

import torch

L2_FLUSH_BYTES = 256 << 20


class DeviceTimer:
    """Times a callable on the device with events; cold L2 per round."""

    def __init__(self, device: torch.device, rounds: int, warmup: int):
        self.device, self.rounds, self.warmup = device, rounds, warmup
        self.cuda = device.type == "cuda"
        self.flush_buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda else None

    def flush(self):
        if self.cuda:
            self.flush_buf.zero_()
            torch.cuda.synchronize()

    def run(self, benchmark, fn) -> list[float]:
        """Benchmark ``fn``; returns the per-round times in microseconds."""
        times: list[float] = []
        for _ in range(self.warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize()

        def timed():
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)

        benchmark.pedantic(timed, setup=self.flush, rounds=self.rounds, iterations=1, warmup_rounds=0)
        if not times:  # --benchmark-disable runs the target once outside pedantic
            timed()
        return times


def percentiles(times_us: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(times_us, n=20, method="inclusive") if len(times_us) > 1 else times_us * 19
    return {"p5_us": round(qs[0], 2), "p50_us": round(statistics.median(times_us), 2), "p95_us": round(qs[18], 2)}
