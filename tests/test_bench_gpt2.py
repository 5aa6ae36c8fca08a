"""The GPT-2 benchmark's inputs and clock (CPU: host clock marks; the GPU uses CUDA events the same way)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from bench.bench_gpt2 import CLOCK_VS_WALL_PCT, prompt_lengths  # noqa: E402
from fused_attn.generate import _result, run_backend  # noqa: E402
from tests.prompts import left_padded  # noqa: E402


def test_prompt_lengths_are_distinct_and_span_half_the_prompt():
    assert prompt_lengths(1, 128) == [128]
    lengths = prompt_lengths(16, 128)
    assert len(set(lengths)) == 16 and lengths[0] == 128 and lengths[-1] == 64
    assert prompt_lengths(16, 512)[-1] == 256


def test_gpt2_batches_take_the_option_or_the_sweeps_default():
    from bench.bench_gpt2 import gpt2_batches

    assert gpt2_batches(None, False) == (1, 16) and gpt2_batches(None, True) == (1, 4, 16, 64)
    assert gpt2_batches("2, 3,2", False) == (2, 3)
    for bad in ("", "0", "2,x", "-1", "1.5"):
        with pytest.raises(pytest.UsageError, match=r"--bench-gpt2-batches must be a comma list of positive "
                                                    r"integers, got "):
            gpt2_batches(bad, False)


def test_result_splits_marks_into_ttft_and_token_gaps():
    r = _result("x", torch.zeros(1, 3), [0.0, 1.0, 1.5, 2.5, 2.75], 3.0)
    assert (r.ttft_s, r.step_s, r.total_s, r.wall_s) == (1.0, [0.5, 1.25], 2.75, 3.0)
    assert r.new_tokens == 3
    one = _result("x", torch.zeros(1, 1), [0.0, 1.0, 1.25], 1.25)
    assert (one.ttft_s, one.step_s, one.new_tokens) == (1.25, [], 1)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)).eval()


@pytest.mark.parametrize("backend", ["hf-eager", "hf-static", "hf-fused", "graph"])
def test_every_backend_reports_token_times_that_add_up_to_wall_time(backend):
    model = tiny_gpt2()
    ids, mask = left_padded(64, prompt_lengths(3, 12), seed=0)
    r = run_backend(backend, model, ids, mask, 5, torch.float32, torch.device("cpu"))
    assert r.new_tokens == 5 and r.tokens.shape == (3, 12 + 5)
    assert abs(r.total_s - r.wall_s) / r.wall_s * 100 <= CLOCK_VS_WALL_PCT


def test_weight_floor_counts_every_parameter_once():
    from bench.bench_gpt2 import weight_floor_ms

    model = torch.nn.Linear(1000, 500)  # 500500 parameters
    nbytes, ms = weight_floor_ms(model, torch.float16, copy_gbps=1000.0)
    assert nbytes == 2 * 500_500 and ms == pytest.approx(2 * 500_500 / 1e12 * 1e3)


def test_kv_bytes_per_step_counts_each_rows_own_keys_over_the_decode_steps():
    """GPT-2 small at batch 16, prompt 128 (rows 128 .. 64 long), 128 new tokens, float16: the steps
    feeding tokens 1 .. 127 read 16 rows x (length + s) keys, K and V, 12 layers x 768 x 2 bytes."""
    from types import SimpleNamespace

    from bench.bench_gpt2 import kv_bytes_per_step

    config = SimpleNamespace(num_hidden_layers=12, hidden_size=768)
    lengths = prompt_lengths(16, 128)
    keys = sum(sum(n + s for n in lengths) for s in range(1, 128)) / 127  # mean over the decode steps
    assert kv_bytes_per_step(config, lengths, 128, torch.float16) == round(2 * 12 * 768 * 2 * keys)
    assert kv_bytes_per_step(config, [128], 128, torch.float32) == round(2 * 12 * 768 * 4 * (128 + 64))
    assert kv_bytes_per_step(config, [5, 3], 1, torch.float16) == 0  # one token: no decode step


@pytest.mark.parametrize("backend", ["hf-eager", "graph"])
def test_sampled_cases_run_with_the_benchmarks_sampling_settings(backend):
    """--full's ``-sample`` cases call run_backend with SAMPLING: every kind of backend takes it and
    draws tokens (seeded: the same twice), reported on the same clock as the greedy cases."""
    from bench.bench_gpt2 import SAMPLING

    model = tiny_gpt2()
    ids, mask = left_padded(64, prompt_lengths(3, 12), seed=0)
    runs = [run_backend(backend, model, ids, mask, 6, torch.float32, torch.device("cpu"), **SAMPLING)
            for _ in range(2)]
    assert runs[0].new_tokens == 6 and torch.equal(runs[0].tokens, runs[1].tokens)
    greedy = run_backend(backend, model, ids, mask, 6, torch.float32, torch.device("cpu"))
    assert not torch.equal(runs[0].tokens, greedy.tokens)
    assert abs(runs[0].total_s - runs[0].wall_s) / runs[0].wall_s * 100 <= CLOCK_VS_WALL_PCT


def test_launches_between_marks_counts_kernels_between_each_two_marks_by_start_time():
    from bench.bench_gpt2 import MARK_KERNEL, launches_between_marks

    mark = f"at::cuda::(anonymous namespace)::{MARK_KERNEL}(long)"
    # Out of order on purpose (the profiler's event list is not sorted by start); kernels before the first mark
    # (the prefill) and after the last are outside every step; copies and fills are not kernels.
    events = [("gemv", 5.0), (mark, 4.0), ("prefill_gemm", 1.0), ("norm", 4.5), (mark, 0.5), (mark, 6.0),
              ("Memcpy DtoD (Device -> Device)", 4.2), ("Memset (Device)", 6.5), ("attn", 7.0), (mark, 8.0),
              ("after", 9.0)]
    assert launches_between_marks(events) == [1, 2, 1]
    assert launches_between_marks([("gemv", 1.0), (mark, 2.0)]) == []
    assert launches_between_marks([(mark, 1.0), (mark, 2.0)]) == [0]
