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


# The staged 16-row tensor-core GEMVs issue every x piece of a group before their first weight read
# (bench/sass_issue_order.py; the fence in mma_walk_pieces). A performance property of the compiled code,
# checked from SASS: without the fence ptxas put three of six pieces behind the weights' arrival.
_SASS_STAGED = """
        Function : _ZN10fused_attn6linear17linear_mma_kernelI6__halfLi2ELb1ELb1ELb0ELb0EEEvNS_12LinearParamsE
        /*0100*/  @!P2 LDG.E.NA.LTC256B.128.CONSTANT R16, desc[UR6][R8.64] ;  /* 0x0 */
        /*0110*/  ACQBULK ;  /* 0x0 */
        /*0120*/  LDGSTS.E.128 [R5], desc[UR6][R40.64], P1 ;  /* 0x0 */
        /*0130*/  {between}  /* 0x0 */
        /*0140*/  LDGSTS.E.128 [R5+0x200], desc[UR6][R36.64], P2 ;  /* 0x0 */
        /*0150*/  HMMA.16816.F32 R44, R36, R40, R44 ;  /* 0x0 */
"""


@pytest.mark.parametrize("between, late", [("IMAD.MOV.U32 R38, RZ, RZ, R17 ;", 1),  # reads a weight register
                                           ("IMAD.MOV.U32 R17, RZ, RZ, R2 ;", 0),    # writes one: not a read
                                           ("IMAD.MOV.U32 R38, RZ, RZ, R29 ;", 0)])  # another register
def test_sass_issue_order_counts_pieces_behind_a_weight_read(between, late):
    from bench import sass_issue_order as order

    funcs = order.functions(_SASS_STAGED.format(between=between))
    (lines,) = funcs.values()
    assert order.issue_order(lines) == (2, late)


# Staged builds: fp16 / bf16 x whole-K / split-K x twelve builds (three activations x bias / residual present
# or not, linear_kernel.cuh's with_build_epilogue).
def test_staged_gemv_issues_x_before_its_first_weight_read(capsys):
    from bench import sass_issue_order as order
    from conftest import HAS_NVCC, NO_NVCC_REASON

    if not HAS_NVCC:
        pytest.skip(NO_NVCC_REASON)
    if order.find_cuobjdump() is None:
        pytest.skip("needs cuobjdump (CUDA toolkit, PATH or Triton's copy)")
    rc = order.main([])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("staged") == 2 * 2 * 3 * 4, out


_PTXAS_LOG = """ptxas info    : Compiling entry function '_Z1kv' for 'sm_90a'
ptxas info    : Function properties for _Z1kv
    8 bytes stack frame, 8 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 8 bytes cumulative stack size, 24576 bytes smem
ptxas info    : Function properties for _Z1jv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 78 registers, used 1 barriers, 24576 bytes smem
"""
_SASS_COUNTS = """
        Function : _Z1kv
        /*0000*/  STL [R1], R12 ;  /* 0x0 */
        /*0010*/  LDG.E.NA.LTC256B.128.CONSTANT R16, desc[UR6][R8.64] ;  /* 0x0 */
        /*0020*/  ACQBULK ;  /* 0x0 */
        /*0030*/  NOP ;  /* 0x0 */
        /*0040*/  LDG.E.128 R40, desc[UR6][R2.64] ;  /* 0x0 */
        /*0050*/  HMMA.16816.F32 R44, R36, R40, R44 ;  /* 0x0 */
        /*0060*/  HMMA.16816.F32 R44, R36, R40, R44 ;  /* 0x0 */
        /*0070*/  LDL.LU R10, [R1] ;  /* 0x0 */
        /*0080*/  STG.E.U16 desc[UR6][R4.64], R10 ;  /* 0x0 */
        /*0090*/  EXIT ;  /* 0x0 */
"""


def test_sass_stats_reads_ptxas_usage_and_static_counts():
    from bench import sass_issue_order as order
    from bench import sass_stats

    assert sass_stats.ptxas_usage(_PTXAS_LOG) == {"_Z1kv": (80, 8, 16), "_Z1jv": (78, 0, 0)}
    (lines,) = order.functions(_SASS_COUNTS).values()
    # 9 without the NOP; 2 before the wait; the wait and a load up to the first MMA; 3 after the last MMA; one
    # STL and one LDL
    assert sass_stats.counts(lines) == (9, 2, 2, 3, 2)
