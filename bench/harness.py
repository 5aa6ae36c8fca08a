"""Device timing for the benchmarks and tools (bench/conftest.py, bench_<op>.py, bench.ab, bench.bytes).

The one definition of the CUDA-event timing loop (``events_around``), the percentiles of a
case, the device's bandwidth ceilings and the read/write roofline, and of the process state every
measurement starts from (``settle_process``).

Each timed round: zero a 256 MiB buffer (evicts the previous round's data, its dirty outputs
included), read another 256 MiB buffer (evicts the zeroing's own dirty lines: L2 then holds only
clean lines, so no write-back of earlier data lands in the timed window), queue a spin kernel,
then record the start event, the call and the end event while the device still spins. A round in
which the spin ended before the end event was queued (the device waited on the host inside the
timed window) is timed again with a spin twice as long; the spin length used is in extra_info.
"""

from __future__ import annotations

import gc
import statistics
import time

import pytest
import torch

L2_FLUSH_BYTES = 256 << 20


# GPU work queued ahead of each timed call (after the L2 flush): while the device spins,
# the host enqueues the start event and the call, so the interval between the events is
# device time only, never host launch overhead (~10-60 us for a Python op or a compiled
# graph, ~100 us for an autograd backward, more than a small kernel takes). Checked every round.
SPIN_CYCLES = 400_000  # ~200 us at 1.98 GHz
# ~13 ms: PyTorch chains of several ops (bench_sample's eager / compiled top-k peers) took 3-4.4 ms of host time to
# queue in bench_sample's H100 runs of a3059c3 (2026-11-28), past the 3.2 ms the cap allowed before
# (SPIN_CYCLES << 4), and were dropped; a call that synchronizes inside still lets every spin finish and is still
# refused.
MAX_SPIN_CYCLES = SPIN_CYCLES << 6
# Before each case's warm-up calls: ~20 ms of spinning, so every case starts from a busy GPU at its
# boost clock whatever ran before it (a compile, an idle gap, a heavy case). Kernels of a few us
# move with the SM clock: back-to-back H200 runs differed by 2-4% at N = 128, the empty kernel
# by 2% (docs/lab-notes/softmax.md, "Clock warm-up").
CLOCK_WARMUP_CYCLES = 40_000_000


def events_around(fn) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """Record a start event, call ``fn``, record an end event (on the current stream); returns the
    two events without waiting for them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    return start, end


class EventClock:
    """A clock for pytest-benchmark that advances by the CUDA-event time of each timed call,
    so pytest-benchmark's statistics (and --benchmark-compare) are device times."""

    __name__ = "cuda_event_clock"

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def __repr__(self) -> str:
        return "cuda_event_clock"


class DeviceTimer:
    """Times a callable on the device with events; cold L2 per round."""

    def __init__(self, device: torch.device, rounds: int, warmup: int):
        self.device, self.rounds, self.warmup = device, rounds, warmup
        self.cuda = device.type == "cuda"
        self.spin_cycles = SPIN_CYCLES
        self._copy_cache: dict[int, float] = {}
        if self.cuda:
            self.flush_buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
            self.sweep_buf = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.float32, device=device)
            self._sweep_sum = torch.empty((), dtype=torch.float32, device=device)
            self._spin_done = torch.cuda.Event()

    def flush(self):
        """Evict L2 and leave it clean (a 256 MiB write, then a 256 MiB read of another buffer),
        then queue a spin; returns without waiting for any of it."""
        if self.cuda:
            self.flush_buf.zero_()
            torch.sum(self.sweep_buf, dim=0, out=self._sweep_sum)
            torch.cuda._sleep(self.spin_cycles)
            self._spin_done.record()

    def time_once(self, fn) -> float:
        """Seconds of one call: CUDA events on the GPU (queued behind flush(); re-timed after a new
        flush with a longer spin while the spin did not outlast queueing the call), host clock on
        the CPU."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        while True:
            t0 = time.perf_counter()
            start, end = events_around(fn)
            host_ahead = not self._spin_done.query()  # still spinning: everything was queued in time
            host_us = (time.perf_counter() - t0) * 1e6
            end.synchronize()
            if host_ahead:
                return start.elapsed_time(end) * 1e-3
            if self.spin_cycles >= MAX_SPIN_CYCLES:
                # A call that waits for the device inside (a synchronizing allocation, a recompile) lets
                # every spin finish: its host time says which.
                raise RuntimeError(f"the spin kernel must outlast host enqueueing, got the device idle before "
                                   f"the call was queued even with {self.spin_cycles} cycles (the call took "
                                   f"{host_us:.0f} us on the host)")
            self.spin_cycles *= 2
            self.flush()

    def _warm_up(self, fn) -> None:
        if self.cuda:
            torch.cuda._sleep(CLOCK_WARMUP_CYCLES)
        for _ in range(self.warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize()

    def sample(self, fn) -> list[float]:
        """Per-round times in microseconds, without pytest-benchmark (bench/ab.py)."""
        self._warm_up(fn)
        times = []
        for _ in range(self.rounds):
            self.flush()
            times.append(self.time_once(fn) * 1e6)
        return times

    def launch_floor_us(self) -> float:
        """p50 of an empty kernel timed like every case: what no kernel, however small, goes below."""
        return statistics.median(self.sample(lambda: torch.cuda._sleep(0)))

    def same_bytes_copy_us(self, nbytes: int) -> float:
        """p50 of a device-to-device copy that moves ``nbytes`` in all (nbytes / 2 read, nbytes / 2
        written), timed like every case: what moving nbytes costs at this size, ramp-up, tail and the
        cold L2 included (a kernel far below the copy bandwidth may still be at this floor). Cached
        per size."""
        if nbytes not in self._copy_cache:
            half = max(16, nbytes // 2 // 16 * 16)
            src = torch.empty(half, dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            self._copy_cache[nbytes] = statistics.median(self.sample(lambda: dst.copy_(src)))
        return self._copy_cache[nbytes]

    def run(self, benchmark, fn) -> list[float]:
        """Benchmark ``fn``; returns the per-round times in microseconds."""
        times: list[float] = []
        self._warm_up(fn)
        clock = EventClock()

        def timed():
            seconds = self.time_once(fn)
            times.append(seconds * 1e6)
            clock.now += seconds

        benchmark._timer = clock  # read by pedantic's runner around each round
        benchmark.pedantic(timed, setup=self.flush, rounds=self.rounds, iterations=1, warmup_rounds=0)
        if not times:  # --benchmark-disable runs the target once outside pedantic
            self.flush()
            timed()
        return times


def positive_ints(text: str) -> list[int]:
    """A command line's comma list of positive integers ("1,4, 16"); ValueError naming what it got."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"must be a comma list of positive integers, got {text!r}")
    return values


def percentiles(times_us: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(times_us, n=20, method="inclusive") if len(times_us) > 1 else times_us * 19
    return {"p5_us": round(qs[0], 2), "p50_us": round(statistics.median(times_us), 2), "p95_us": round(qs[18], 2)}


def roofline_us(read: int, write: int, ceilings: dict[str, float]) -> float:
    """Lower bound on the time to move (read, write) bytes, in us, from the device ceilings
    measured in GB/s: mixed traffic at the copy rate, and each direction at its own rate
    (a causal softmax writes twice what it reads and is bound by the write rate)."""
    return max((read + write) / ceilings["copy"], read / ceilings["read"], write / ceilings["write"]) / 1e3


# Streams joined into the launching stream before anything is measured (settle_process).
SETTLE_STREAMS = 6


def settle_process(streams: int = SETTLE_STREAMS) -> None:
    """Put this process where any process that has done real work is: a small op on each of `streams`
    fresh streams, each joined back into the current stream. On an H200 (2026-11-28,
    docs/lab-notes/launch-overhead-pdl.md) a process's programmatic launches (our kernels' PDL edges) reach
    the SMs ~0.35 us later once it has joined a few other streams or captured a few graphs, for good and
    process-wide (batch-16 GPT-2 step ~289 -> ~303 us a step; three to five joins were enough); launches
    without the attribute do not change. Without this the first cases of a process, or a selection with no
    graph-capturing peer before ours, would measure a young process that users never run. No-op without a GPU."""
    if not torch.cuda.is_available():
        return
    keep = []
    for _ in range(streams):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            keep.append(torch.ones(1024, device="cuda") + 1)
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def measure_ceilings(nbytes: int = 1 << 30, reps: int = 15) -> dict[str, float]:
    """Device bandwidths in GB/s (1e9 B/s), medians over reps with CUDA events: copy
    (bytes read + written by a device-to-device copy), read (a float32 sum), write (fill_)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ops = {"copy": (lambda: dst.copy_(src), 2 * nbytes), "read": (lambda: src.sum(), nbytes),
           "write": (lambda: dst.fill_(1.0), nbytes)}
    out = {}
    for name, (fn, moved) in ops.items():
        fn()
        times = []
        for _ in range(reps):
            start, end = events_around(fn)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        out[name] = moved / statistics.median(times) / 1e9
    return out


def bandwidth_info(read: int, write: int, p50_us: float, ceilings: dict[str, float] | None, timer,
                   launch_floor_us: float | None) -> dict:
    """The bandwidth figures of a memory-bound case's extra_info from its modeled (read, write) bytes and
    p50: GB/s; on a GPU (``ceilings`` measured) also % of the copy bandwidth, the read/write roofline, and
    the two floors timed like every case: a device copy of the same bytes (small cases are bound by
    ramp-up, tail and DRAM latency, not bandwidth: the copy is what they can be held to) and an empty kernel."""
    gbps = (read + write) / (p50_us * 1e-6) / 1e9
    info = dict(modeled_read_bytes=read, modeled_write_bytes=write, modeled_bytes=read + write, gbps=round(gbps, 1))
    if ceilings:
        info.update({f"{k}_gbps": round(v, 1) for k, v in ceilings.items()})
        info["pct_of_copy_bw"] = round(100 * gbps / ceilings["copy"], 1)
        info["roofline_us"] = round(roofline_us(read, write, ceilings), 2)
        info["pct_of_roofline"] = round(100 * info["roofline_us"] / p50_us, 1)
        copy_us = timer.same_bytes_copy_us(read + write)
        info["same_bytes_copy_us"] = round(copy_us, 2)
        info["pct_of_same_bytes_copy"] = round(100 * copy_us / p50_us, 1)
        info["launch_floor_us"] = round(launch_floor_us, 2)
        info["spin_cycles"] = timer.spin_cycles
    return info


def same_run_speedups(medians: dict, group: str, provider: str, p50_us: float, bases) -> dict:
    """Record this case's p50 in ``medians`` (keyed by (group, provider)) and return
    ``speedup_vs_<base>`` for every base provider already measured in the same group."""
    medians[(group, provider)] = p50_us
    return {f"speedup_vs_{base}": round(medians[(group, base)] / p50_us, 3)
            for base in bases if (group, base) in medians and provider != base}


def matmul_peak(dtype: torch.dtype, n: int = 8192, reps: int = 20) -> float:
    """The device's measured dense-matmul ceiling in TFLOP/s (1e12 FLOP/s): the median over ``reps``
    of an n x n x n ``torch.mm`` in ``dtype`` (cuBLAS), 2 n^3 FLOPs each, CUDA events. What an
    attention kernel's TFLOP/s is compared with (its two GEMMs run at most at this rate)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(reps):
        start, end = events_around(lambda: torch.mm(a, b))
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * n**3 / statistics.median(times) / 1e12


def start_case(benchmark, group: str, provider: str, device: torch.device, gpu_only) -> int | None:
    """The opening of a large-input case: skip a GPU-only provider without a GPU, name the group (before
    the run: it is stored then), and on a GPU release the previous cases' memory; returns the free
    device memory in bytes (None on the CPU) for the case's own size check."""
    if device.type == "cpu" and provider in gpu_only:
        pytest.skip(f"{provider} is measured on a GPU only (no CUDA device here)")
    benchmark.group = group
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]
