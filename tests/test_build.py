"""The build's inputs: generated instantiation units up to date, unique source names (CPU, no compiler)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fused_attn import build

ROOT = Path(__file__).resolve().parent.parent


import pytest


@pytest.mark.parametrize("op", ["softmax", "decode_attention", "layer_norm", "attention", "linear"])
def test_generated_instantiation_units_are_up_to_date(op):
    script = ROOT / "csrc" / op / "generate_instantiations.py"
    r = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_sources_cover_every_unit_with_unique_names():
    found = build.sources()
    names = [p.stem for p in found]
    assert len(names) == len(set(names))
    assert {"softmax", "softmax_inst_fp16_v1_vec", "softmax_inst_bf16_bwd_scalar"} <= set(names)
    assert {"decode_attention", "decode_attention_inst_fp16_hd128", "decode_attention_inst_fp32_combine"} <= set(names)
    assert {"layer_norm", "layer_norm_inst_fp16_ln_vec", "layer_norm_inst_bf16_rms_scalar"} <= set(names)
    assert {"attention", "attention_inst_fp16_hd128", "attention_inst_fp32_naive"} <= set(names)



@pytest.mark.parametrize("archs, defined", [
    (["9.0a"], True), (["8.0", "9.0a"], True), (["9.0a+PTX"], True),
    (["9.0"], False), (["9.0", "9.0a"], False), (["8.0"], False),
])
def test_sm90a_kernels_are_enabled_only_when_sm90_devices_run_the_9_0a_build(archs, defined):
    """The wgmma flash kernel is selected only where an sm_90 device cannot load a plain sm_90 pass (whose
    version of it is empty)."""
    assert (build.arch_defines(archs) == ["-DFUSED_ATTN_SM90A"]) == defined
