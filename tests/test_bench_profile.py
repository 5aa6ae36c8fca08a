"""bench.profile writes its tables and traces (CPU run; on a GPU it also lists kernels)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from bench import profile  # noqa: E402


def test_profile_writes_layer_and_kernel_tables(tmp_path):
    assert profile.main(["--backends", "hf-eager,graph", "--prompt-len", "8", "--new-tokens", "3",
                         "--out", str(tmp_path)]) == 0
    for backend in ("hf-eager", "graph", "graph-eager"):
        assert (tmp_path / f"kernels_{backend}.txt").exists()
        json.loads((tmp_path / f"trace_{backend}.json").read_text())
    for backend in ("hf-eager", "graph-eager"):  # labelled runs: every part got time
        rows = {ln.split()[0]: float(ln.split()[1]) for ln in (tmp_path / f"layers_{backend}.txt").read_text()
                .splitlines()[2:-1]}
        assert set(rows) == set(profile.PARTS)
        assert all(rows[p] > 0 for p in ("ln_1", "attention", "ln_2", "mlp", "lm_head")), rows
        # transformers adds the residuals in the block; our GPT-2 adds them in the output projections
        # (fused_attn.gpt2.Block: attention and mlp take the residual), so they count there
        assert (rows["residual"] > 0) == (backend == "hf-eager"), rows
    md = (tmp_path / "profile.md").read_text()
    assert "## hf-eager" in md and "## graph-eager" in md


def test_profile_rejects_an_unknown_backend(tmp_path):
    with pytest.raises(SystemExit, match=r"--backends must name .*, got 'nope'"):
        profile.main(["--backends", "nope", "--out", str(tmp_path)])


def test_part_times_use_kernel_time_under_cpu_scopes_not_gpu_ranges():
    """On a GPU the profiler records every scope twice: the CPU-side op (whose
    device_time_total sums its kernels) and a GPU range spanning first to last kernel,
    idle gaps included. Only the former may count."""
    import torch
    from types import SimpleNamespace

    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [SimpleNamespace(name=n, device_type=d, device_time_total=t, cpu_time_total=0.0) for n, d, t in [
        ("block", cpu, 100.0), ("attention", cpu, 40.0), ("mlp", cpu, 50.0), ("ln_1", cpu, 2.0), ("ln_2", cpu, 2.0),
        ("block", gpu, 9000.0), ("attention", gpu, 5000.0), ("some_kernel", gpu, 7.0)]]
    prof = SimpleNamespace(events=lambda: events)
    times = profile.part_times(prof, on_gpu=True)
    assert times["attention"] == 40.0 and times["mlp"] == 50.0
    assert times["residual"] == 100.0 - 94.0


def ev(name: str, start: float, end: float):
    """A profiler device event of kernel `name` over [start, end] (us), as critical_path reads it."""
    import torch
    from types import SimpleNamespace

    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                           time_range=SimpleNamespace(start=start, end=end))


def test_critical_path_credits_each_kernel_with_its_end_past_the_latest_end():
    """Under programmatic dependent launch a kernel starts before the previous one ends: its increment
    is its end minus the latest end before it (not its duration), the increments add up to the step, and
    only the steps after the skipped ones (each ending with `sample`) count."""
    from types import SimpleNamespace

    gemv = "void fused_attn::linear::linear_gemv_kernel<__half, 1, 4>(fused_attn::LinearParams)"
    events, t = [], 0.0
    for _ in range(5):  # per step: a GEMV (3 us past the last end, started 5 us early), a kernel 1 us past
        # it, the sampler 1 us past that
        events += [ev(gemv, t - 5, t + 3), ev("void tiny_kernel()", t + 2, t + 4), ev("void sample_kernel()", t + 3, t + 5)]
        t += 5
    rows = {ln[:90].strip(): ln[90:].split() for ln in profile.critical_path(SimpleNamespace(events=lambda: events))}
    # the last column, the head start: the GEMV starts 5 us before the sampler before it ends, the tiny kernel
    # 1 us before the GEMV ends, the sampler 1 us before the tiny kernel ends
    assert rows["linear_gemv_kernel<__half, 1, 4>"] == ["1.0", "3.00", "3.00", "60.0%", "5.00"]
    assert rows["tiny_kernel"] == ["1.0", "1.00", "1.00", "20.0%", "1.00"]
    assert rows["sample_kernel"] == ["1.0", "1.00", "1.00", "20.0%", "1.00"]
    assert rows["step (sample end to sample end)"] == ["3.0", "5.00"]
    assert profile.critical_path(SimpleNamespace(events=lambda: events[:6]))[0].startswith("(fewer than 4")


def test_critical_path_head_start_is_negative_for_a_kernel_that_starts_after_the_one_before_ends():
    """A kernel whose blocks start only after the kernel before it has ended (no room on the SMs, no
    programmatic launch) shows a negative head start: the gap it began after that end."""
    from types import SimpleNamespace

    events, t = [], 0.0
    for _ in range(5):  # per step: a kernel 2 us after the sampler's end, the sampler 1 us before it ends
        events += [ev("void late_kernel()", t + 2, t + 6), ev("void sample_kernel()", t + 5, t + 8)]
        t += 8
    rows = {ln[:90].strip(): ln[90:].split() for ln in profile.critical_path(SimpleNamespace(events=lambda: events))}
    assert rows["late_kernel"] == ["1.0", "6.00", "6.00", "75.0%", "-2.00"]
    assert rows["sample_kernel"] == ["1.0", "2.00", "2.00", "25.0%", "1.00"]
