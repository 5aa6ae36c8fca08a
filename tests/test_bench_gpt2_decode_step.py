"""The GPT-2 decode-step benchmark: providers, cases and its bytes model (CPU only; the GPU numbers come
from bench/run_gpu.sh's gpt2step step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("pytest_benchmark")
pytest.importorskip("transformers")

from bench import bench_gpt2_decode_step as step  # noqa: E402
from fused_attn.generate import GRAPH_BACKENDS  # noqa: E402


def _config(full=False, dtypes=None):
    opts = {"--full": full, "--bench-dtypes": dtypes}
    return SimpleNamespace(getoption=opts.__getitem__)


def test_providers_put_the_baselines_first_and_fused_last():
    assert step.PROVIDERS == ("eager", "compiled", "fused_modules", "fused")
    assert all(step.PROVIDERS.index(b) < step.PROVIDERS.index("fused") for b in step.SPEEDUP_BASES)
    assert step.REPORT_LABELS["bench_gpt2_decode_step"]["order"] == step.PROVIDERS
    assert set(step.BACKEND_OF) == set(step.PROVIDERS) and set(step.BACKEND_OF.values()) <= set(GRAPH_BACKENDS)
    assert GRAPH_BACKENDS[step.BACKEND_OF["fused"]]["step"] == "persistent"


def test_quick_is_float16_and_full_adds_bfloat16():
    quick = step.make_cases(_config())
    assert {c["dtype"] for c in quick} == {"float16"} and len(quick) == 2 * 2 * len(step.PROVIDERS)
    assert {c["dtype"] for c in step.make_cases(_config(full=True))} == {"float16", "bfloat16"}
    assert step.case_id(quick[0]) == "eager-b1-l128-float16"


def test_modeled_bytes_of_gpt2_small():
    from fused_attn.gpt2 import GPT2

    model = GPT2.from_hf(step.hf_small(), torch.float16)
    read, write = step.modeled_traffic(model, 1, 128)
    # 124,439,808 parameters (wte once: the lm_head is tied) in float16; K and V of 129 slots x 12 layers
    assert read == 2 * 124_439_808 + 2 * 12 * 129 * 768 * 2
    assert write == 2 * 12 * 768 * 2 + 50257 * 2
