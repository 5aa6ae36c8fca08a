"""The build's inputs: generated instantiation units up to date, unique source names (CPU, no compiler)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fused_attn import build

ROOT = Path(__file__).resolve().parent.parent


import pytest


@pytest.mark.parametrize("op", sorted(p.parent.name for p in (ROOT / "csrc").glob("*/generate_instantiations.py")))
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
    assert {"linear", "linear_inst_fp16_m8_norm", "sample", "sample_inst_bf16"} <= set(names)


def test_programmatic_kernels_read_no_input_through_ldg():
    """A kernel that waits for its primary (griddepcontrol.wait, common/pdl.cuh) reads the previous
    kernel's output: an __ldg there is an invariant load, which the compiler may issue before the wait
    (graph-fused's GEMVs at 8-16 rows read x early in replayed graphs). Their weights go
    through load_stream / prefetch_l2; nothing in such a file calls __ldg."""
    waiting = [p for p in (ROOT / "csrc").glob("*/*.cuh") if "wait_for_primary()" in p.read_text()
               and p.name != "pdl.cuh"]
    assert {"linear_kernel.cuh", "decode_attention_kernel.cuh", "sample_kernel.cuh"} <= {p.name for p in waiting}
    offenders = [f"{p.relative_to(ROOT)}:{i + 1}" for p in waiting
                 for i, line in enumerate(p.read_text().splitlines()) if "__ldg(" in line]
    assert not offenders, f"__ldg in kernels launched as programmatic dependents: {offenders}"



@pytest.mark.parametrize("archs, defined", [
    (["9.0a"], True), (["8.0", "9.0a"], True), (["9.0a+PTX"], True),
    (["9.0"], False), (["9.0", "9.0a"], False), (["8.0"], False),
])
def test_sm90a_kernels_are_enabled_only_when_sm90_devices_run_the_9_0a_build(archs, defined):
    """The wgmma flash kernel is selected only where an sm_90 device cannot load a plain sm_90 pass (whose
    version of it is empty)."""
    assert (build.arch_defines(archs) == ["-DFUSED_ATTN_SM90A"]) == defined
